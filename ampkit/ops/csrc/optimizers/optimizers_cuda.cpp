// CUDA registration of the ampkit_optimizers ops: the CPU path's checks (list_checks.h) and one launch per
// tensor of the kernels in optimizers_kernels.cu, or, under AMPKIT_CUDA_KERNELS=multi_tensor, one launch per planned
// block of tensors of those in optimizers_multi_tensor.cu (RMSprop, RMSprop-TF, Adadelta, LAMB, NovoGrad) (the per-element math is optimizer_math.h and the
// hyper-parameters hyper.h, shared with the CPU kernels). The ops that take GradScaler's grad_scale and
// found_inf pass them to the kernels as device pointers and keep their step counters on the device, so a
// step costs no read back to the host; LAMB and NovoGrad read step counters and per-tensor values there.
// Compiled only when torch sees a GPU at build time (ampkit.ops._build passes it as a CUDA source);
// registered under the CUDA key, which takes precedence over the CompositeExplicitAutograd CPU kernels for
// CUDA tensors.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <initializer_list>
#include <map>
#include <optional>
#include <vector>

#include "common/kernel_choice.h"
#include "optimizers/hyper.h"
#include "optimizers/list_checks.h"
#include "optimizers/op_checks.h"
#include "optimizers/optimizers_cuda.h"
#include "optimizers/optimizers_multi_tensor.h"

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

// AMPKIT_CUDA_KERNELS=multi_tensor: the ops below that have both run their multi-tensor kernels (read per call).
bool multi_tensor_kernels() { return cuda_kernels() == CudaKernels::kMultiTensor; }

// Runs `launch()` on params[0]'s device (nothing for an empty list).
template <class F>
void on_params_device(at::TensorList params, const F& launch) {
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  launch();
}

// The bucket as the multi-tensor launchers take it: tensor t's slot d is lists[d][t] (nullptr where lists[d] is
// empty: an optional list the op does not use).
std::vector<cuda::TensorSlots> slots_of(at::TensorList params, std::initializer_list<at::TensorList> lists) {
  std::vector<cuda::TensorSlots> slots(params.size());
  for (size_t t = 0; t < params.size(); ++t) {
    slots[t] = {{}, params[t].numel(), static_cast<int64_t>(t)};
    int d = 0;
    for (const at::TensorList list : lists) slots[t].ptr[d++] = list.empty() ? nullptr : list[t].data_ptr();
  }
  return slots;
}

// A per-tensor float64 CPU vector (checked by per_tensor_values) copied to params[0]'s device, where the
// multi-tensor kernels read it: a host-to-device copy, no read back.
at::Tensor on_device(const at::Tensor& values, at::TensorList params) {
  at::Tensor copy = at::empty({values.numel()}, values.options().device(params[0].device()));
  copy.copy_(values, /*non_blocking=*/true);
  return copy;
}

at::TensorList if_used(bool used, at::TensorList list) { return used ? list : at::TensorList{}; }

template <typename param_t, typename acc_t>
cuda::ParamSlot<param_t, acc_t> slot(at::TensorList params, at::TensorList masters, size_t t) {
  return {ptr<param_t>(params[t]), masters.empty() ? nullptr : ptr<acc_t>(masters[t])};
}

// GradScaler's tensors as the kernels take them, checked first (ListChecker::scaling).
cuda::ScalerPtrs scaler_ptrs(const ListChecker& check, const std::optional<at::Tensor>& grad_scale,
                             const std::optional<at::Tensor>& found_inf) {
  check.scaling(grad_scale, found_inf);
  return {grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr,
          found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr};
}

// Advances every step counter on the device after the kernels that read it, unless found_inf says skip.
void bump_device_steps(at::TensorList steps, const cuda::ScalerPtrs& scaler) {
  if (steps.empty()) return;
  const c10::cuda::CUDAGuard guard(steps[0].device());
  std::vector<float*> ptrs;
  ptrs.reserve(steps.size());
  for (const at::Tensor& s : steps) ptrs.push_back(s.data_ptr<float>());
  cuda::launch_bump_steps(ptrs.data(), static_cast<int64_t>(ptrs.size()), scaler.found_inf, current_stream());
}

void adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList master_params,
                    at::TensorList steps, double lr, double beta1, double beta2, double eps, double weight_decay,
                    bool adam_w_mode, bool amsgrad, bool bias_correction, double grad_factor,
                    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const ListChecker check("adam_step", params, c10::DeviceType::CUDA);
  const CheckedArgs args =
      check_adam_args(check, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps, amsgrad);
  const cuda::ScalerPtrs scaler = scaler_ptrs(check, grad_scale, found_inf);
  const cuda::AdamArgs adam{lr, beta1, beta2, eps, weight_decay, grad_factor, bias_correction};
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    for_each_tensor(params, [&](size_t t) {
      cuda::launch_adam<param_t, grad_t, acc_t>(
          slot<param_t, acc_t>(params, master_params, t), ptr<grad_t>(grads[t]), ptr<acc_t>(exp_avgs[t]),
          ptr<acc_t>(exp_avg_sqs[t]), amsgrad ? ptr<acc_t>(max_exp_avg_sqs[t]) : nullptr, params[t].numel(), adam,
          ptr<float>(steps[t]), scaler, adam_w_mode, current_stream());
    });
  });
  bump_device_steps(steps, scaler);
}

void sgd_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                   at::TensorList master_params, double lr, double weight_decay, double momentum, double dampening,
                   bool nesterov, bool first_step, double grad_factor, const std::optional<at::Tensor>& grad_scale,
                   const std::optional<at::Tensor>& found_inf) {
  const ListChecker check("sgd_step", params, c10::DeviceType::CUDA);
  const bool use_momentum = momentum != 0.0;
  const CheckedArgs args = check_sgd_args(check, grads, momentum_buffers, master_params, use_momentum);
  const cuda::ScalerPtrs scaler = scaler_ptrs(check, grad_scale, found_inf);
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    const SGDHyper<acc_t> h = sgd_hyper<acc_t>(lr, weight_decay, momentum, dampening, grad_factor);
    for_each_tensor(params, [&](size_t t) {
      cuda::launch_sgd<param_t, grad_t, acc_t>(slot<param_t, acc_t>(params, master_params, t),
                                               ptr<grad_t>(grads[t]),
                                               use_momentum ? ptr<acc_t>(momentum_buffers[t]) : nullptr,
                                               params[t].numel(), h, grad_factor, scaler, nesterov, first_step,
                                               current_stream());
    });
  });
}

void adagrad_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList state_sums,
                       at::TensorList master_params, at::TensorList steps, double lr, double lr_decay,
                       double weight_decay, double eps, double grad_factor,
                       const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const ListChecker check("adagrad_step", params, c10::DeviceType::CUDA);
  const CheckedArgs args = check_adagrad_args(check, grads, state_sums, master_params, steps);
  const cuda::ScalerPtrs scaler = scaler_ptrs(check, grad_scale, found_inf);
  const cuda::AdagradArgs adagrad{lr, lr_decay, weight_decay, eps, grad_factor};
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    for_each_tensor(params, [&](size_t t) {
      cuda::launch_adagrad<param_t, grad_t, acc_t>(slot<param_t, acc_t>(params, master_params, t),
                                                   ptr<grad_t>(grads[t]), ptr<acc_t>(state_sums[t]),
                                                   params[t].numel(), adagrad, ptr<float>(steps[t]), scaler,
                                                   current_stream());
    });
  });
  bump_device_steps(steps, scaler);
}

void rmsprop_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList square_avgs,
                       at::TensorList grad_avgs, at::TensorList momentum_buffers, at::TensorList master_params,
                       at::TensorList steps, double lr, double alpha, double eps, double weight_decay,
                       double momentum, bool centered, double grad_factor,
                       const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const ListChecker check("rmsprop_step", params, c10::DeviceType::CUDA);
  const bool use_momentum = momentum > 0.0;
  const CheckedArgs args = check_rmsprop_args(check, grads, square_avgs, grad_avgs, momentum_buffers,
                                              master_params, steps, centered, use_momentum);
  const cuda::ScalerPtrs scaler = scaler_ptrs(check, grad_scale, found_inf);
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    const auto h = rmsprop_hyper<acc_t>(lr, alpha, eps, weight_decay, momentum, grad_factor);
    if (multi_tensor_kernels()) {
      const auto slots = slots_of(params, {params, grads, square_avgs, if_used(centered, grad_avgs),
                                           if_used(use_momentum, momentum_buffers), master_params});
      on_params_device(params, [&] {
        cuda::launch_rmsprop_multi<param_t, grad_t, acc_t>(slots.data(), slots.size(), h, grad_factor, scaler,
                                                           centered, use_momentum, current_stream());
      });
      return;
    }
    for_each_tensor(params, [&](size_t t) {
      cuda::launch_rmsprop<param_t, grad_t, acc_t>(
          slot<param_t, acc_t>(params, master_params, t), ptr<grad_t>(grads[t]), ptr<acc_t>(square_avgs[t]),
          centered ? ptr<acc_t>(grad_avgs[t]) : nullptr, use_momentum ? ptr<acc_t>(momentum_buffers[t]) : nullptr,
          params[t].numel(), h, grad_factor, scaler, current_stream());
    });
  });
  bump_device_steps(steps, scaler);
}

void rmsprop_tf_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList square_avgs,
                          at::TensorList grad_avgs, at::TensorList momentum_buffers, at::TensorList master_params,
                          at::TensorList steps, double lr, double alpha, double eps, double weight_decay,
                          double momentum, bool centered, bool decoupled_decay, bool lr_in_momentum,
                          double grad_factor, const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf) {
  const ListChecker check("rmsprop_tf_step", params, c10::DeviceType::CUDA);
  const bool use_momentum = momentum > 0.0;
  const CheckedArgs args = check_rmsprop_args(check, grads, square_avgs, grad_avgs, momentum_buffers,
                                              master_params, steps, centered, use_momentum);
  const cuda::ScalerPtrs scaler = scaler_ptrs(check, grad_scale, found_inf);
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    const auto h = rmsprop_tf_hyper<acc_t>(lr, alpha, eps, weight_decay, momentum, decoupled_decay, grad_factor);
    if (multi_tensor_kernels()) {
      const auto slots = slots_of(params, {params, grads, square_avgs, if_used(centered, grad_avgs),
                                           if_used(use_momentum, momentum_buffers), master_params});
      on_params_device(params, [&] {
        cuda::launch_rmsprop_tf_multi<param_t, grad_t, acc_t>(slots.data(), slots.size(), h, grad_factor, scaler,
                                                              centered, use_momentum, lr_in_momentum,
                                                              current_stream());
      });
      return;
    }
    for_each_tensor(params, [&](size_t t) {
      cuda::launch_rmsprop_tf<param_t, grad_t, acc_t>(
          slot<param_t, acc_t>(params, master_params, t), ptr<grad_t>(grads[t]), ptr<acc_t>(square_avgs[t]),
          centered ? ptr<acc_t>(grad_avgs[t]) : nullptr, use_momentum ? ptr<acc_t>(momentum_buffers[t]) : nullptr,
          params[t].numel(), h, grad_factor, scaler, lr_in_momentum, current_stream());
    });
  });
  bump_device_steps(steps, scaler);
}

void adadelta_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList square_avgs,
                        at::TensorList acc_deltas, at::TensorList master_params, at::TensorList steps, double lr,
                        double rho, double eps, double weight_decay, double grad_factor,
                        const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const ListChecker check("adadelta_step", params, c10::DeviceType::CUDA);
  const CheckedArgs args = check_adadelta_args(check, grads, square_avgs, acc_deltas, master_params, steps);
  const cuda::ScalerPtrs scaler = scaler_ptrs(check, grad_scale, found_inf);
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    const auto h = adadelta_hyper<acc_t>(lr, rho, eps, weight_decay, grad_factor);
    if (multi_tensor_kernels()) {
      const auto slots = slots_of(params, {params, grads, square_avgs, acc_deltas, master_params});
      on_params_device(params, [&] {
        cuda::launch_adadelta_multi<param_t, grad_t, acc_t>(slots.data(), slots.size(), h, grad_factor, scaler,
                                                            current_stream());
      });
      return;
    }
    for_each_tensor(params, [&](size_t t) {
      cuda::launch_adadelta<param_t, grad_t, acc_t>(slot<param_t, acc_t>(params, master_params, t),
                                                    ptr<grad_t>(grads[t]), ptr<acc_t>(square_avgs[t]),
                                                    ptr<acc_t>(acc_deltas[t]), params[t].numel(), h, grad_factor,
                                                    scaler, current_stream());
    });
  });
  bump_device_steps(steps, scaler);
}

void lamb_stage1_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList updates, at::TensorList master_params,
                      at::TensorList steps, double beta1, double beta2, double eps, double weight_decay,
                      bool adam_w_mode, bool grad_averaging, bool bias_correction, double grad_factor) {
  const ListChecker check("lamb_stage1", params, c10::DeviceType::CUDA);
  const CheckedArgs args = check_lamb_stage1_args(check, grads, exp_avgs, exp_avg_sqs, updates, master_params, steps);
  const std::vector<double> step = bump_steps(steps);
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    if (multi_tensor_kernels()) {  // one launch series per step count (one, unless params joined late)
      const auto all = slots_of(params, {params, grads, exp_avgs, exp_avg_sqs, updates, master_params});
      std::map<double, std::vector<cuda::TensorSlots>> by_step;
      for (size_t t = 0; t < all.size(); ++t) by_step[step[t]].push_back(all[t]);
      on_params_device(params, [&] {
        for (const auto& [count, slots] : by_step) {
          const auto h = lamb_hyper<acc_t>(count, beta1, beta2, eps, weight_decay, grad_averaging, bias_correction,
                                           grad_factor);
          cuda::launch_lamb_stage1_multi<param_t, grad_t, acc_t>(slots.data(), slots.size(), h, adam_w_mode,
                                                                 current_stream());
        }
      });
      return;
    }
    for_each_tensor(params, [&](size_t t) {
      const auto h = lamb_hyper<acc_t>(step[t], beta1, beta2, eps, weight_decay, grad_averaging, bias_correction,
                                       grad_factor);
      cuda::launch_lamb_stage1<param_t, grad_t, acc_t>(
          ptr<param_t>(params[t]), master_params.empty() ? nullptr : ptr<acc_t>(master_params[t]),
          ptr<grad_t>(grads[t]), ptr<acc_t>(exp_avgs[t]), ptr<acc_t>(exp_avg_sqs[t]), ptr<acc_t>(updates[t]),
          params[t].numel(), h, adam_w_mode, current_stream());
    });
  });
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
    if (multi_tensor_kernels()) {
      const auto slots = slots_of(params, {params, updates, master_params});
      on_params_device(params, [&] {
        const at::Tensor device_ratios = on_device(ratios, params);
        cuda::launch_lamb_stage2_multi<param_t, acc_t>(slots.data(), slots.size(), device_ratios.data_ptr<double>(),
                                                       current_stream());
      });
      return;
    }
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
  const CheckedArgs args = check_novograd_args(check, grads, exp_avgs, master_params);
  const double* d = per_tensor_values("novograd_step", "denoms", denoms, params.size());
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    if (multi_tensor_kernels()) {  // the denominators go to the device; the kernel reads each tensor's there
      const auto h = novograd_hyper<acc_t>(0.0, lr, beta1, weight_decay, grad_averaging, bias_correction1, grad_factor);
      const auto slots = slots_of(params, {params, grads, exp_avgs, master_params});
      on_params_device(params, [&] {
        const at::Tensor device_denoms = on_device(denoms, params);
        cuda::launch_novograd_multi<param_t, grad_t, acc_t>(slots.data(), slots.size(), h,
                                                            device_denoms.data_ptr<double>(), reg_inside_moment,
                                                            current_stream());
      });
      return;
    }
    for_each_tensor(params, [&](size_t t) {
      const auto h =
          novograd_hyper<acc_t>(d[t], lr, beta1, weight_decay, grad_averaging, bias_correction1, grad_factor);
      cuda::launch_novograd<param_t, grad_t, acc_t>(slot<param_t, acc_t>(params, master_params, t),
                                                    ptr<grad_t>(grads[t]), ptr<acc_t>(exp_avgs[t]),
                                                    params[t].numel(), h, reg_inside_moment, current_stream());
    });
  });
}

// AdamP, one tensor at a time (three launches for a matrix: moments and row sums, the projection choice, the
// update), its choice made on the device. Not the default yet: ampkit.ops runs it on CUDA only under
// AMPKIT_CUDA_KERNELS=multi_tensor until a GPU run has checked it, and the reference (torch ops) otherwise.
void adamp_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                     at::TensorList master_params, at::TensorList steps, double lr, double beta1, double beta2,
                     double eps, double weight_decay, double delta, double wd_ratio, bool nesterov,
                     double grad_factor) {
  const ListChecker check("adamp_step", params, c10::DeviceType::CUDA);
  const CheckedArgs args = check_adamp_args(check, grads, exp_avgs, exp_avg_sqs, master_params, steps);
  const std::vector<double> step = bump_steps(steps);
  const cuda::AdamPProjection projection{lr * weight_decay, delta, wd_ratio, eps};
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    for_each_tensor(params, [&](size_t t) {
      const int64_t numel = params[t].numel();
      if (numel == 0) return;
      const int64_t rows = params[t].dim() > 1 ? params[t].size(0) : 0;
      const int64_t cols = rows > 0 ? numel / rows : numel;
      at::Tensor scratch;
      if (rows > 0) scratch = at::zeros({rows * 5 + 1}, params[t].options().dtype(at::kDouble));
      cuda::launch_adamp<param_t, grad_t, acc_t>(
          slot<param_t, acc_t>(params, master_params, t), ptr<grad_t>(grads[t]), ptr<acc_t>(exp_avgs[t]),
          ptr<acc_t>(exp_avg_sqs[t]), rows, cols, adamp_hyper<acc_t>(step[t], lr, beta1, beta2, eps, grad_factor),
          projection, nesterov, rows > 0 ? scratch.data_ptr<double>() : nullptr, current_stream());
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
  m.impl("adamp_step", &adamp_step_cuda);
}

}  // namespace optim
}  // namespace ampkit
