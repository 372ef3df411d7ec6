// First line of the translation unit, so every function shares the attribute and still inlines and
// vectorizes: no FMA contraction, to round like torch.optim (see optimizer_math.h).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
// The ampkit_optimizers op schemas (torch.ops.ampkit_optimizers.*) and the first-order kernels: Adam/AdamW
// (one pass reading param, grad and both moments) and SGD with momentum. Kernels are registered under
// CompositeExplicitAutograd, so calls whose lists are all empty (no tensor to pick a device from) still
// dispatch; they reject non-CPU tensors by name. Kept in one translation unit with the schemas: each
// unit costs ~10 s of torch-header parsing in the cold build.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_multi_tensor.h"
#include "hyper.h"
#include "op_checks.h"

TORCH_LIBRARY(ampkit_optimizers, m) {
  m.def(
      "adam_step(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] master_params, Tensor(f!)[] steps, float lr, float beta1, "
      "float beta2, float eps, float weight_decay, bool adam_w_mode, bool amsgrad, bool bias_correction, "
      "float grad_factor, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
  m.def(
      "sgd_step(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] momentum_buffers, Tensor(e!)[] master_params, "
      "float lr, float weight_decay, float momentum, float dampening, bool nesterov, bool first_step, "
      "float grad_factor, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
  m.def(
      "adagrad_step(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] state_sums, Tensor(e!)[] master_params, "
      "Tensor(f!)[] steps, float lr, float lr_decay, float weight_decay, float eps, float grad_factor, "
      "Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
  m.def(
      "rmsprop_step(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] square_avgs, Tensor(c!)[] grad_avgs, "
      "Tensor(d!)[] momentum_buffers, Tensor(e!)[] master_params, Tensor(f!)[] steps, float lr, float alpha, "
      "float eps, float weight_decay, float momentum, bool centered, float grad_factor, "
      "Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
  m.def(
      "rmsprop_tf_step(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] square_avgs, Tensor(c!)[] grad_avgs, "
      "Tensor(d!)[] momentum_buffers, Tensor(e!)[] master_params, Tensor(f!)[] steps, float lr, float alpha, "
      "float eps, float weight_decay, float momentum, bool centered, bool decoupled_decay, bool lr_in_momentum, "
      "float grad_factor, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
  m.def(
      "adadelta_step(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] square_avgs, Tensor(c!)[] acc_deltas, "
      "Tensor(e!)[] master_params, Tensor(f!)[] steps, float lr, float rho, float eps, float weight_decay, "
      "float grad_factor, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
  m.def(
      "lamb_stage1(Tensor[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] updates, Tensor[] master_params, Tensor(f!)[] steps, float beta1, float beta2, float eps, "
      "float weight_decay, bool adam_w_mode, bool grad_averaging, bool bias_correction, float grad_factor) -> ()");
  m.def(
      "lamb_stage2(Tensor(a!)[] params, Tensor[] updates, Tensor(e!)[] master_params, Tensor ratios) -> ()");
  m.def(
      "novograd_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(e!)[] master_params, "
      "Tensor denoms, float lr, float beta1, float weight_decay, bool reg_inside_moment, bool grad_averaging, "
      "float bias_correction1, float grad_factor) -> ()");
  m.def(
      "adamp_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(e!)[] master_params, Tensor(f!)[] steps, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, float delta, float wd_ratio, bool nesterov, float grad_factor) -> ()");
}

namespace ampkit {
namespace optim {
namespace {

void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList master_params,
                   at::TensorList steps, double lr, double beta1, double beta2, double eps, double weight_decay,
                   bool adam_w_mode, bool amsgrad, bool bias_correction, double grad_factor,
                   const std::optional<at::Tensor>& grad_scale,
                   const std::optional<at::Tensor>& found_inf) {
  const ListChecker check("adam_step", params);
  const CheckedArgs args =
      check_adam_args(check, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps, amsgrad);
  const CpuScaling scaling = read_scaling(check, grad_scale, found_inf, grad_factor);
  if (scaling.skip) return;  // before the step counters move

  const std::vector<double> step = bump_steps(steps);

  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    std::vector<AdamHyper<acc_t>> hyper;
    for (const double s : step) {
      hyper.push_back(
          adam_hyper<acc_t>(s, lr, beta1, beta2, eps, weight_decay, bias_correction, scaling.grad_factor));
    }
    dispatch_bool(adam_w_mode, [&](auto adamw) {
      dispatch_bool(amsgrad, [&](auto ams) {
        parallel_over_elements(check.numels(), [&](size_t t, int64_t begin, int64_t end) {
          const AdamHyper<acc_t>& h = hyper[t];
          const grad_t* __restrict__ g = ptr<grad_t>(grads[t]);
          acc_t* __restrict__ m = ptr<acc_t>(exp_avgs[t]);
          acc_t* __restrict__ v = ptr<acc_t>(exp_avg_sqs[t]);
          acc_t* __restrict__ vmax = ams ? ptr<acc_t>(max_exp_avg_sqs[t]) : v;
          acc_t* master = args.has_master ? ptr<acc_t>(master_params[t]) : nullptr;
          update_params(ptr<param_t>(params[t]), master, begin, end, [&](acc_t& p, int64_t i) {
            acc_t vm = ams ? vmax[i] : acc_t(0);
            adam_element<acc_t, decltype(adamw)::value, decltype(ams)::value>(p, static_cast<acc_t>(g[i]), m[i],
                                                                              v[i], vm, h);
            if (ams) vmax[i] = vm;
          });
        });
      });
    });
    if (scaling.grad_scale != 0.0) unscale_grads<grad_t, acc_t>(grads, check.numels(), scaling.grad_scale);
  });
}


void sgd_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                  at::TensorList master_params, double lr, double weight_decay, double momentum, double dampening,
                  bool nesterov, bool first_step, double grad_factor,
                  const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf) {
  const ListChecker check("sgd_step", params);
  const bool use_momentum = momentum != 0.0;
  const CheckedArgs args = check_sgd_args(check, grads, momentum_buffers, master_params, use_momentum);
  const CpuScaling scaling = read_scaling(check, grad_scale, found_inf, grad_factor);
  if (scaling.skip) return;  // before the step counters move

  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    const SGDHyper<acc_t> h = sgd_hyper<acc_t>(lr, weight_decay, momentum, dampening, scaling.grad_factor);
    dispatch_bool(use_momentum, [&](auto mom) {
      dispatch_bool(nesterov, [&](auto nest) {
        dispatch_bool(first_step, [&](auto first) {
          parallel_over_elements(check.numels(), [&](size_t t, int64_t begin, int64_t end) {
            const grad_t* __restrict__ g = ptr<grad_t>(grads[t]);
            acc_t* __restrict__ buf = mom ? ptr<acc_t>(momentum_buffers[t]) : nullptr;
            acc_t* master = args.has_master ? ptr<acc_t>(master_params[t]) : nullptr;
            update_params(ptr<param_t>(params[t]), master, begin, end, [&](acc_t& p, int64_t i) {
              acc_t b = mom ? buf[i] : acc_t(0);
              sgd_element<acc_t, decltype(mom)::value, decltype(nest)::value, decltype(first)::value>(
                  p, static_cast<acc_t>(g[i]), b, h);
              if (mom) buf[i] = b;
            });
          });
        });
      });
    });
    if (scaling.grad_scale != 0.0) unscale_grads<grad_t, acc_t>(grads, check.numels(), scaling.grad_scale);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(ampkit_optimizers, CompositeExplicitAutograd, m) {
  m.impl("adam_step", &adam_step_cpu);
  m.impl("sgd_step", &sgd_step_cpu);
}

}  // namespace optim
}  // namespace ampkit
