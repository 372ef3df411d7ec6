// Launchers of the fused optimizer CUDA kernels (optimizers_kernels.cu): raw pointers of one tensor,
// its element count and the same hyper-parameter structs the CPU kernels use. A tensor-level CUDA
// dispatch (the counterpart of *_cpu.cpp) would call these per tensor, or per chunk list.
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

template <typename param_t, typename grad_t, typename acc_t>
void launch_adam(ParamSlot<param_t, acc_t> p, const grad_t* grad, acc_t* exp_avg, acc_t* exp_avg_sq,
                 acc_t* max_exp_avg_sq, int64_t n, const AdamHyper<acc_t>& h, bool adam_w_mode, cudaStream_t stream);

template <typename param_t, typename grad_t, typename acc_t>
void launch_sgd(ParamSlot<param_t, acc_t> p, const grad_t* grad, acc_t* momentum_buffer, int64_t n,
                const SGDHyper<acc_t>& h, bool nesterov, bool first_step, cudaStream_t stream);

template <typename param_t, typename grad_t, typename acc_t>
void launch_adagrad(ParamSlot<param_t, acc_t> p, const grad_t* grad, acc_t* state_sum, int64_t n,
                    const AdagradHyper<acc_t>& h, cudaStream_t stream);

template <typename param_t, typename grad_t, typename acc_t>
void launch_rmsprop(ParamSlot<param_t, acc_t> p, const grad_t* grad, acc_t* square_avg, acc_t* grad_avg,
                    acc_t* momentum_buffer, int64_t n, const RMSpropHyper<acc_t>& h, cudaStream_t stream);

template <typename param_t, typename grad_t, typename acc_t>
void launch_rmsprop_tf(ParamSlot<param_t, acc_t> p, const grad_t* grad, acc_t* square_avg, acc_t* grad_avg,
                       acc_t* momentum_buffer, int64_t n, const RMSpropTFHyper<acc_t>& h, bool lr_in_momentum,
                       cudaStream_t stream);

template <typename param_t, typename grad_t, typename acc_t>
void launch_adadelta(ParamSlot<param_t, acc_t> p, const grad_t* grad, acc_t* square_avg, acc_t* acc_delta,
                     int64_t n, const AdadeltaHyper<acc_t>& h, cudaStream_t stream);

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

}  // namespace cuda
}  // namespace optim
}  // namespace ampkit
