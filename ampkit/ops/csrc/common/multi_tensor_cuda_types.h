// Plain types shared by the CUDA launchers and their host-side callers (no device code, no ATen).
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

#include "common/chunk_plan.h"  // TensorSlots: one tensor of a list

namespace ampkit {
namespace cuda {

// Element types a launcher is told about (the tensor-level code maps at::ScalarType onto these).
enum class Dtype : int { kFloat = 0, kHalf = 1, kBFloat16 = 2, kDouble = 3 };

// The overflow flag: one float or int32 element, set to 1 by any thread that sees a non-finite value.
struct FlagRef {
  void* ptr;
  bool is_float;
  C10_HOST_DEVICE void raise() const {  // called by kernels only
    if (is_float) {
      *static_cast<float*>(ptr) = 1.f;
    } else {
      *static_cast<int*>(ptr) = 1;
    }
  }
};

}  // namespace cuda
}  // namespace ampkit
