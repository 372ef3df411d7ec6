// Launchers of the multi-tensor optimizer kernels (optimizers_multi_tensor.cu), which AMPKIT_CUDA_KERNELS=
// multi_tensor selects for the optimizers torch has no fused op for. Each takes the bucket as TensorSlots (one
// launch per planned block of tensors, common/chunk_plan.h) in the slot order its comment gives, nullptr where
// an optional list is absent; the hyper-parameters and GradScaler's device pointers are those of the per-tensor
// launchers (optimizers_cuda.h), so both kinds compute the same numbers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/multi_tensor_cuda_types.h"
#include "optimizers/optimizer_math.h"
#include "optimizers/optimizers_cuda.h"

namespace ampkit {
namespace optim {
namespace cuda {

using ampkit::cuda::TensorSlots;

// slots: param, grad, square_avg, grad_avg (with `centered`), momentum_buffer (with `momentum`), master.
template <typename param_t, typename grad_t, typename acc_t>
void launch_rmsprop_multi(const TensorSlots* tensors, int64_t count, const RMSpropHyper<acc_t>& h,
                          double grad_factor, ScalerPtrs scaler, bool centered, bool momentum, cudaStream_t stream);

template <typename param_t, typename grad_t, typename acc_t>
void launch_rmsprop_tf_multi(const TensorSlots* tensors, int64_t count, const RMSpropTFHyper<acc_t>& h,
                             double grad_factor, ScalerPtrs scaler, bool centered, bool momentum,
                             bool lr_in_momentum, cudaStream_t stream);

// slots: param, grad, square_avg, acc_delta, master.
template <typename param_t, typename grad_t, typename acc_t>
void launch_adadelta_multi(const TensorSlots* tensors, int64_t count, const AdadeltaHyper<acc_t>& h,
                           double grad_factor, ScalerPtrs scaler, cudaStream_t stream);

// slots: param, grad, exp_avg, exp_avg_sq, update, master; every tensor shares `h` (one step count).
template <typename param_t, typename grad_t, typename acc_t>
void launch_lamb_stage1_multi(const TensorSlots* tensors, int64_t count, const LambHyper<acc_t>& h, bool adam_w_mode,
                              cudaStream_t stream);

// slots: param, update, master; ratios[index] (device float64) is each tensor's lr x trust ratio.
template <typename param_t, typename acc_t>
void launch_lamb_stage2_multi(const TensorSlots* tensors, int64_t count, const double* ratios, cudaStream_t stream);

// slots: param, grad, exp_avg, master; denoms[index] (device float64) replaces h.denom per tensor.
template <typename param_t, typename grad_t, typename acc_t>
void launch_novograd_multi(const TensorSlots* tensors, int64_t count, const NovoGradHyper<acc_t>& h,
                           const double* denoms, bool reg_inside_moment, cudaStream_t stream);

}  // namespace cuda
}  // namespace optim
}  // namespace ampkit
