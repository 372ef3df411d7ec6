// Device-side pieces both kinds of optimizer kernels use (one launch per tensor in optimizers_kernels.cu,
// multi-tensor in optimizers_multi_tensor.cu): torch's GradScaler contract read where the kernel runs, parameter
// loads through the optional fp32 master copy, and the launch check.
#pragma once

#include <c10/util/Exception.h>

#include "optimizers/optimizers_cuda.h"

namespace ampkit {
namespace optim {
namespace cuda {

inline void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

template <typename param_t, typename acc_t>
__device__ inline acc_t load_param(const ParamSlot<param_t, acc_t>& p, int64_t i) {
  return p.master != nullptr ? p.master[i] : static_cast<acc_t>(p.param[i]);
}

template <typename param_t, typename acc_t>
__device__ inline void store_param(const ParamSlot<param_t, acc_t>& p, int64_t i, acc_t value) {
  if (p.master != nullptr) p.master[i] = value;
  p.param[i] = static_cast<param_t>(value);
}

// GradScaler's contract, read by every thread of a kernel (the same two cached words).
__device__ inline bool skipped(const ScalerPtrs& s) { return s.found_inf != nullptr && *s.found_inf != 0.0f; }

// The factor each gradient is multiplied by: grad_factor / grad_scale, in double like the host computes it.
__device__ inline double unscaled_factor(double grad_factor, const ScalerPtrs& s) {
  return s.grad_scale != nullptr ? grad_factor / static_cast<double>(*s.grad_scale) : grad_factor;
}

// Divisor of the gradients written back (0: leave them), as torch._foreach_div_ by a float32 scale rounds it.
template <typename acc_t>
__device__ inline acc_t write_back_scale(const ScalerPtrs& s) {
  return s.grad_scale != nullptr ? static_cast<acc_t>(*s.grad_scale) : acc_t(0);
}

template <typename grad_t, typename acc_t>
__device__ inline void write_unscaled(grad_t* grad, int64_t i, acc_t g, acc_t scale) {
  if (scale != acc_t(0)) grad[i] = static_cast<grad_t>(g / scale);
}

// Launches kernel<..., B>(args) with a runtime bool turned into a template argument.
#define AMPKIT_BOOL_SWITCH(flag, NAME, ...) \
  do {                                      \
    if (flag) {                             \
      constexpr bool NAME = true;           \
      __VA_ARGS__;                          \
    } else {                                \
      constexpr bool NAME = false;          \
      __VA_ARGS__;                          \
    }                                       \
  } while (0)

}  // namespace cuda
}  // namespace optim
}  // namespace ampkit
