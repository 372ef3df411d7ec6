// Dtype dispatch for the four float types, as a generic lambda receiving a value of the C++ type:
//   dispatch_float(t.scalar_type(), "inputs", [&](auto tag) { using T = decltype(tag); ... });
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

namespace ampkit {

template <typename F>
inline void dispatch_float(at::ScalarType type, const char* what, F&& f) {
  switch (type) {
    case at::kFloat:
      f(float{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    case at::kDouble:
      f(double{});
      break;
    default:
      TORCH_CHECK(false, what, ": unsupported dtype ", type, "; expected float32, float16, bfloat16 or float64");
  }
}

}  // namespace ampkit
