// CUDA registration of the ampkit_optimizers ops: the CPU path's checks (list_checks.h), hyper-parameters
// computed on the host from the CPU step counters exactly as the CPU kernels compute them, and one launch
// per tensor of the kernels in optimizers_kernels.cu (the per-element math is optimizer_math.h, shared with
// the CPU kernels). Compiled only when torch sees a GPU at build time (ampkit.ops._build passes it as a
// CUDA source); registered under the CUDA key, which takes precedence over the CompositeExplicitAutograd
// CPU kernels for CUDA tensors.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "optimizers/list_checks.h"
#include "optimizers/optimizers_cuda.h"

namespace ampkit {
namespace optim {
namespace {

// Runs on params[0]'s device and stream; `launch(t)` is called for every non-empty tensor t.
template <class F>
void for_each_tensor(at::TensorList params, const F& launch) {
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  for (size_t t = 0; t < params.size(); ++t) {
    if (params[t].numel() > 0) launch(t);
  }
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

template <typename param_t, typename acc_t>
cuda::ParamSlot<param_t, acc_t> slot(at::TensorList params, at::TensorList masters, size_t t) {
  return {ptr<param_t>(params[t]), masters.empty() ? nullptr : ptr<acc_t>(masters[t])};
}

void adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList master_params,
                    at::TensorList steps, double lr, double beta1, double beta2, double eps, double weight_decay,
                    bool adam_w_mode, bool amsgrad, bool bias_correction, double grad_factor) {
  const ListChecker check("adam_step", params, c10::DeviceType::CUDA);
  const at::ScalarType grad_dtype = check.grads(grads);
  check.state("exp_avgs", exp_avgs);
  check.state("exp_avg_sqs", exp_avg_sqs);
  check.optional_state("max_exp_avg_sqs", max_exp_avg_sqs, amsgrad);
  check.master(master_params);
  check.steps(steps);
  dispatch_param_grad(check.param_dtype(), grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    for (size_t t = 0; t < params.size(); ++t) {
      const double step = bump_step(steps[t]);
      if (params[t].numel() == 0) continue;
      const c10::cuda::CUDAGuard guard(params[t].device());
      const double bc1 = bias_correction ? 1.0 - std::pow(beta1, step) : 1.0;
      const double bc2 = bias_correction ? 1.0 - std::pow(beta2, step) : 1.0;
      const AdamHyper<acc_t> h{acc_t(grad_factor),    acc_t(beta1),        acc_t(beta2),
                               acc_t(1.0 - beta1),    acc_t(1.0 - beta2),  acc_t(eps),
                               acc_t(weight_decay),   acc_t(1.0 - lr * weight_decay),
                               acc_t(lr / bc1),       acc_t(std::sqrt(bc2))};
      cuda::launch_adam<param_t, grad_t, acc_t>(
          slot<param_t, acc_t>(params, master_params, t), ptr<grad_t>(grads[t]), ptr<acc_t>(exp_avgs[t]),
          ptr<acc_t>(exp_avg_sqs[t]), amsgrad ? ptr<acc_t>(max_exp_avg_sqs[t]) : nullptr, params[t].numel(), h,
          adam_w_mode, current_stream());
    }
  });
}

void sgd_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                   at::TensorList master_params, double lr, double weight_decay, double momentum, double dampening,
                   bool nesterov, bool first_step, double grad_factor) {
  const ListChecker check("sgd_step", params, c10::DeviceType::CUDA);
  const at::ScalarType grad_dtype = check.grads(grads);
  const bool use_momentum = momentum != 0.0;
  check.optional_state("momentum_buffers", momentum_buffers, use_momentum);
  check.master(master_params);
  dispatch_param_grad(check.param_dtype(), grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    const SGDHyper<acc_t> h{acc_t(grad_factor), acc_t(lr), acc_t(weight_decay), acc_t(momentum),
                            acc_t(1.0 - dampening)};
    for_each_tensor(params, [&](size_t t) {
      cuda::launch_sgd<param_t, grad_t, acc_t>(slot<param_t, acc_t>(params, master_params, t),
                                               ptr<grad_t>(grads[t]),
                                               use_momentum ? ptr<acc_t>(momentum_buffers[t]) : nullptr,
                                               params[t].numel(), h, nesterov, first_step, current_stream());
    });
  });
}

void adagrad_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList state_sums,
                       at::TensorList master_params, at::TensorList steps, double lr, double lr_decay,
                       double weight_decay, double eps, double grad_factor) {
  const ListChecker check("adagrad_step", params, c10::DeviceType::CUDA);
  const at::ScalarType grad_dtype = check.grads(grads);
  check.state("state_sums", state_sums);
  check.master(master_params);
  check.steps(steps);
  std::vector<double> clr(params.size());
  for (size_t i = 0; i < params.size(); ++i) clr[i] = lr / (1.0 + (bump_step(steps[i]) - 1.0) * lr_decay);
  dispatch_param_grad(check.param_dtype(), grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    for_each_tensor(params, [&](size_t t) {
      const AdagradHyper<acc_t> h{acc_t(grad_factor), acc_t(clr[t]), acc_t(weight_decay), acc_t(eps)};
      cuda::launch_adagrad<param_t, grad_t, acc_t>(slot<param_t, acc_t>(params, master_params, t),
                                                   ptr<grad_t>(grads[t]), ptr<acc_t>(state_sums[t]),
                                                   params[t].numel(), h, current_stream());
    });
  });
}

void rmsprop_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList square_avgs,
                       at::TensorList grad_avgs, at::TensorList momentum_buffers, at::TensorList master_params,
                       at::TensorList steps, double lr, double alpha, double eps, double weight_decay,
                       double momentum, bool centered, double grad_factor) {
  const ListChecker check("rmsprop_step", params, c10::DeviceType::CUDA);
  const at::ScalarType grad_dtype = check.grads(grads);
  const bool use_momentum = momentum > 0.0;
  check.state("square_avgs", square_avgs);
  check.optional_state("grad_avgs", grad_avgs, centered);
  check.optional_state("momentum_buffers", momentum_buffers, use_momentum);
  check.master(master_params);
  check.steps(steps);
  for (const at::Tensor& s : steps) bump_step(s);
  dispatch_param_grad(check.param_dtype(), grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    const RMSpropHyper<acc_t> h{acc_t(grad_factor), acc_t(lr),           acc_t(alpha),   acc_t(1.0 - alpha),
                                acc_t(eps),         acc_t(weight_decay), acc_t(momentum)};
    for_each_tensor(params, [&](size_t t) {
      cuda::launch_rmsprop<param_t, grad_t, acc_t>(
          slot<param_t, acc_t>(params, master_params, t), ptr<grad_t>(grads[t]), ptr<acc_t>(square_avgs[t]),
          centered ? ptr<acc_t>(grad_avgs[t]) : nullptr, use_momentum ? ptr<acc_t>(momentum_buffers[t]) : nullptr,
          params[t].numel(), h, current_stream());
    });
  });
}

void rmsprop_tf_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList square_avgs,
                          at::TensorList grad_avgs, at::TensorList momentum_buffers, at::TensorList master_params,
                          at::TensorList steps, double lr, double alpha, double eps, double weight_decay,
                          double momentum, bool centered, bool decoupled_decay, bool lr_in_momentum,
                          double grad_factor) {
  const ListChecker check("rmsprop_tf_step", params, c10::DeviceType::CUDA);
  const at::ScalarType grad_dtype = check.grads(grads);
  const bool use_momentum = momentum > 0.0;
  check.state("square_avgs", square_avgs);
  check.optional_state("grad_avgs", grad_avgs, centered);
  check.optional_state("momentum_buffers", momentum_buffers, use_momentum);
  check.master(master_params);
  check.steps(steps);
  for (const at::Tensor& s : steps) bump_step(s);
  dispatch_param_grad(check.param_dtype(), grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    const RMSpropTFHyper<acc_t> h{acc_t(grad_factor),
                                  acc_t(lr),
                                  acc_t(alpha),
                                  acc_t(1.0 - alpha),
                                  acc_t(eps),
                                  acc_t(decoupled_decay ? 0.0 : weight_decay),
                                  acc_t(decoupled_decay ? 1.0 - lr * weight_decay : 1.0),
                                  acc_t(momentum)};
    for_each_tensor(params, [&](size_t t) {
      cuda::launch_rmsprop_tf<param_t, grad_t, acc_t>(
          slot<param_t, acc_t>(params, master_params, t), ptr<grad_t>(grads[t]), ptr<acc_t>(square_avgs[t]),
          centered ? ptr<acc_t>(grad_avgs[t]) : nullptr, use_momentum ? ptr<acc_t>(momentum_buffers[t]) : nullptr,
          params[t].numel(), h, lr_in_momentum, current_stream());
    });
  });
}

void adadelta_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList square_avgs,
                        at::TensorList acc_deltas, at::TensorList master_params, at::TensorList steps, double lr,
                        double rho, double eps, double weight_decay, double grad_factor) {
  const ListChecker check("adadelta_step", params, c10::DeviceType::CUDA);
  const at::ScalarType grad_dtype = check.grads(grads);
  check.state("square_avgs", square_avgs);
  check.state("acc_deltas", acc_deltas);
  check.master(master_params);
  check.steps(steps);
  for (const at::Tensor& s : steps) bump_step(s);
  dispatch_param_grad(check.param_dtype(), grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    const AdadeltaHyper<acc_t> h{acc_t(grad_factor), acc_t(lr),  acc_t(rho),
                                 acc_t(1.0 - rho),   acc_t(eps), acc_t(weight_decay)};
    for_each_tensor(params, [&](size_t t) {
      cuda::launch_adadelta<param_t, grad_t, acc_t>(slot<param_t, acc_t>(params, master_params, t),
                                                    ptr<grad_t>(grads[t]), ptr<acc_t>(square_avgs[t]),
                                                    ptr<acc_t>(acc_deltas[t]), params[t].numel(), h,
                                                    current_stream());
    });
  });
}

void lamb_stage1_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList updates, at::TensorList master_params,
                      at::TensorList steps, double beta1, double beta2, double eps, double weight_decay,
                      bool adam_w_mode, bool grad_averaging, bool bias_correction, double grad_factor) {
  const ListChecker check("lamb_stage1", params, c10::DeviceType::CUDA);
  const at::ScalarType grad_dtype = check.grads(grads);
  check.state("exp_avgs", exp_avgs);
  check.state("exp_avg_sqs", exp_avg_sqs);
  check.state("updates", updates);
  check.master(master_params);
  check.steps(steps);
  dispatch_param_grad(check.param_dtype(), grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    for (size_t t = 0; t < params.size(); ++t) {
      const double step = bump_step(steps[t]);
      if (params[t].numel() == 0) continue;
      const c10::cuda::CUDAGuard guard(params[t].device());
      const LambHyper<acc_t> h{acc_t(grad_factor),
                               acc_t(beta1),
                               acc_t(beta2),
                               acc_t(grad_averaging ? 1.0 - beta1 : 1.0),
                               acc_t(1.0 - beta2),
                               acc_t(eps),
                               acc_t(weight_decay),
                               acc_t(bias_correction ? 1.0 - std::pow(beta1, step) : 1.0),
                               acc_t(bias_correction ? 1.0 - std::pow(beta2, step) : 1.0)};
      cuda::launch_lamb_stage1<param_t, grad_t, acc_t>(
          ptr<param_t>(params[t]), master_params.empty() ? nullptr : ptr<acc_t>(master_params[t]),
          ptr<grad_t>(grads[t]), ptr<acc_t>(exp_avgs[t]), ptr<acc_t>(exp_avg_sqs[t]), ptr<acc_t>(updates[t]),
          params[t].numel(), h, adam_w_mode, current_stream());
    }
  });
}

// A float64 CPU vector with one entry per tensor (LAMB's lr x trust ratios, NovoGrad's denominators).
const double* per_tensor_values(const char* op, const char* name, const at::Tensor& values, size_t n) {
  TORCH_CHECK(values.device().is_cpu() && values.scalar_type() == at::kDouble && values.dim() == 1 &&
                  values.numel() == static_cast<int64_t>(n) && values.is_contiguous(),
              op, ": ", name, " must be a contiguous float64 CPU vector with one entry per param (", n, "); got ",
              values.scalar_type(), " of shape ", values.sizes(), " on ", values.device());
  return values.data_ptr<double>();
}

void lamb_stage2_cuda(at::TensorList params, at::TensorList updates, at::TensorList master_params,
                      const at::Tensor& ratios) {
  const ListChecker check("lamb_stage2", params, c10::DeviceType::CUDA);
  check.state("updates", updates);
  check.master(master_params);
  const double* r = per_tensor_values("lamb_stage2", "ratios", ratios, params.size());
  dispatch_param_grad(check.param_dtype(), check.param_dtype(), [&](auto ptag, auto) {
    using param_t = typename decltype(ptag)::type;
    using acc_t = acc_type_for<param_t>;
    for_each_tensor(params, [&](size_t t) {
      cuda::launch_lamb_stage2<param_t, acc_t>(slot<param_t, acc_t>(params, master_params, t),
                                               ptr<acc_t>(updates[t]), params[t].numel(), static_cast<acc_t>(r[t]),
                                               current_stream());
    });
  });
}

void novograd_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList master_params, const at::Tensor& denoms, double lr, double beta1,
                        double weight_decay, bool reg_inside_moment, bool grad_averaging, double bias_correction1,
                        double grad_factor) {
  const ListChecker check("novograd_step", params, c10::DeviceType::CUDA);
  const at::ScalarType grad_dtype = check.grads(grads);
  check.state("exp_avgs", exp_avgs);
  check.master(master_params);
  const double* d = per_tensor_values("novograd_step", "denoms", denoms, params.size());
  dispatch_param_grad(check.param_dtype(), grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    for_each_tensor(params, [&](size_t t) {
      const NovoGradHyper<acc_t> h{acc_t(grad_factor),
                                   acc_t(lr),
                                   acc_t(beta1),
                                   acc_t(grad_averaging ? 1.0 - beta1 : 1.0),
                                   acc_t(weight_decay),
                                   acc_t(bias_correction1),
                                   acc_t(d[t])};
      cuda::launch_novograd<param_t, grad_t, acc_t>(slot<param_t, acc_t>(params, master_params, t),
                                                    ptr<grad_t>(grads[t]), ptr<acc_t>(exp_avgs[t]),
                                                    params[t].numel(), h, reg_inside_moment, current_stream());
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(ampkit_optimizers, CUDA, m) {
  m.impl("adam_step", &adam_step_cuda);
  m.impl("sgd_step", &sgd_step_cuda);
  m.impl("adagrad_step", &adagrad_step_cuda);
  m.impl("rmsprop_step", &rmsprop_step_cuda);
  m.impl("rmsprop_tf_step", &rmsprop_tf_step_cuda);
  m.impl("adadelta_step", &adadelta_step_cuda);
  m.impl("lamb_stage1", &lamb_stage1_cuda);
  m.impl("lamb_stage2", &lamb_stage2_cuda);
  m.impl("novograd_step", &novograd_step_cuda);
}

}  // namespace optim
}  // namespace ampkit
