// Launchers of the fused optimizer CUDA kernels (optimizers_kernels.cu): raw pointers of one tensor, its
// element count, the hyper-parameters, and torch's GradScaler contract as device pointers (ScalerPtrs).
// A kernel reads `found_inf` and `grad_scale` where it runs: a non-zero `found_inf` makes it return before
// touching memory, and a `grad_scale` divides each gradient inside the update, which also writes the
// gradient back unscaled. Step counters live on the device too: the step-dependent kernels (Adam, Adagrad)
// read `*step + 1`, and launch_bump_steps advances the counters afterwards unless the step was skipped. No
// launcher reads device memory on the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "optimizers/optimizer_math.h"

namespace ampkit {
namespace optim {
namespace cuda {

// Parameter pointer plus its optional fp32 master copy (nullptr when absent).
template <typename param_t, typename acc_t>
struct ParamSlot {
  param_t* param;
  acc_t* master;
};

// GradScaler's one-element float32 tensors on the device (nullptr when absent).
struct ScalerPtrs {
  const float* grad_scale;
  const float* found_inf;
};

// Adam's and Adagrad's options: their per-element hyper-parameters depend on the step, read on the device.
struct AdamArgs {
  double lr, beta1, beta2, eps, weight_decay, grad_factor;
  bool bias_correction;
};

struct AdagradArgs {
  double lr, lr_decay, weight_decay, eps, grad_factor;
};

template <typename param_t, typename grad_t, typename acc_t>
void launch_adam(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* exp_avg, acc_t* exp_avg_sq, acc_t* max_exp_avg_sq,
                 int64_t n, const AdamArgs& args, const float* step, ScalerPtrs scaler, bool adam_w_mode,
                 cudaStream_t stream);

template <typename param_t, typename grad_t, typename acc_t>
void launch_adagrad(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* state_sum, int64_t n, const AdagradArgs& args,
                    const float* step, ScalerPtrs scaler, cudaStream_t stream);

// The step-independent optimizers take their hyper-parameters built on the host; `grad_factor` is the
// unrounded factor the kernel divides by `grad_scale` before rounding it into h.grad_factor.
template <typename param_t, typename grad_t, typename acc_t>
void launch_sgd(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* momentum_buffer, int64_t n,
                const SGDHyper<acc_t>& h, double grad_factor, ScalerPtrs scaler, bool nesterov, bool first_step,
                cudaStream_t stream);

template <typename param_t, typename grad_t, typename acc_t>
void launch_rmsprop(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* square_avg, acc_t* grad_avg,
                    acc_t* momentum_buffer, int64_t n, const RMSpropHyper<acc_t>& h, double grad_factor,
                    ScalerPtrs scaler, cudaStream_t stream);

template <typename param_t, typename grad_t, typename acc_t>
void launch_rmsprop_tf(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* square_avg, acc_t* grad_avg,
                       acc_t* momentum_buffer, int64_t n, const RMSpropTFHyper<acc_t>& h, double grad_factor,
                       ScalerPtrs scaler, bool lr_in_momentum, cudaStream_t stream);

template <typename param_t, typename grad_t, typename acc_t>
void launch_adadelta(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* square_avg, acc_t* acc_delta, int64_t n,
                     const AdadeltaHyper<acc_t>& h, double grad_factor, ScalerPtrs scaler, cudaStream_t stream);

// Adds one to each of `n` float32 step counters on the device, unless `found_inf` (may be nullptr) is non-zero.
void launch_bump_steps(float* const* steps, int64_t n, const float* found_inf, cudaStream_t stream);

// LAMB and NovoGrad read gradient norms on the host each step, so they take host numbers only.
template <typename param_t, typename grad_t, typename acc_t>
void launch_lamb_stage1(const param_t* param, const acc_t* master, const grad_t* grad, acc_t* exp_avg,
                        acc_t* exp_avg_sq, acc_t* update, int64_t n, const LambHyper<acc_t>& h, bool adam_w_mode,
                        cudaStream_t stream);

template <typename param_t, typename acc_t>
void launch_lamb_stage2(ParamSlot<param_t, acc_t> p, const acc_t* update, int64_t n, acc_t ratio,
                        cudaStream_t stream);

template <typename param_t, typename grad_t, typename acc_t>
void launch_novograd(ParamSlot<param_t, acc_t> p, const grad_t* grad, acc_t* exp_avg, int64_t n,
                     const NovoGradHyper<acc_t>& h, bool reg_inside_moment, cudaStream_t stream);

// AdamP's projection options, in double as the host derives them (lr_wd = lr * weight_decay).
struct AdamPProjection {
  double lr_wd, delta, wd_ratio, eps;
};

// AdamP on one tensor seen as `rows` x `cols` (rows = 0: a vector or scalar of `cols` elements, never projected).
// `scratch` (rows * 5 + 1 doubles, zeroed; nullptr when rows = 0) holds the row sums, the coefficients and the
// decay factor the launches hand each other on the device.
template <typename param_t, typename grad_t, typename acc_t>
void launch_adamp(ParamSlot<param_t, acc_t> p, const grad_t* grad, acc_t* exp_avg, acc_t* exp_avg_sq, int64_t rows,
                  int64_t cols, const AdamPHyper<acc_t>& h, const AdamPProjection& projection, bool nesterov,
                  double* scratch, cudaStream_t stream);

}  // namespace cuda
}  // namespace optim
}  // namespace ampkit
