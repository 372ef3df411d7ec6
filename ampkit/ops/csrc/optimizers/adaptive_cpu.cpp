// First line of the translation unit, so every function shares the attribute and still inlines and
// vectorizes: no FMA contraction, to round like torch.optim (see optimizer_math.h).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
// Fused Adagrad, Adadelta, RMSprop and TF-style RMSprop steps over a list of tensors (CPU).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_multi_tensor.h"
#include "hyper.h"
#include "op_checks.h"

namespace ampkit {
namespace optim {
namespace {

void adagrad_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList state_sums,
                      at::TensorList master_params, at::TensorList steps, double lr, double lr_decay,
                      double weight_decay, double eps, double grad_factor,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf) {
  const ListChecker check("adagrad_step", params);
  const CheckedArgs args = check_adagrad_args(check, grads, state_sums, master_params, steps);
  const CpuScaling scaling = read_scaling(check, grad_scale, found_inf, grad_factor);
  if (scaling.skip) return;  // before the step counters move
  const std::vector<double> step = bump_steps(steps);
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    parallel_over_elements(check.numels(), [&](size_t t, int64_t begin, int64_t end) {
      const auto h = adagrad_hyper<acc_t>(adagrad_clr(step[t], lr, lr_decay), weight_decay, eps, scaling.grad_factor);
      const grad_t* __restrict__ g = ptr<grad_t>(grads[t]);
      acc_t* __restrict__ sum = ptr<acc_t>(state_sums[t]);
      acc_t* master = args.has_master ? ptr<acc_t>(master_params[t]) : nullptr;
      update_params(ptr<param_t>(params[t]), master, begin, end,
                    [&](acc_t& p, int64_t i) { adagrad_element<acc_t>(p, static_cast<acc_t>(g[i]), sum[i], h); });
    });
    if (scaling.grad_scale != 0.0) unscale_grads<grad_t, acc_t>(grads, check.numels(), scaling.grad_scale);
  });
}

void rmsprop_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList square_avgs,
                      at::TensorList grad_avgs, at::TensorList momentum_buffers, at::TensorList master_params,
                      at::TensorList steps, double lr, double alpha, double eps, double weight_decay, double momentum,
                      bool centered, double grad_factor,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf) {
  const ListChecker check("rmsprop_step", params);
  const bool use_momentum = momentum > 0.0;
  const CheckedArgs args = check_rmsprop_args(check, grads, square_avgs, grad_avgs, momentum_buffers,
                                              master_params, steps, centered, use_momentum);
  const CpuScaling scaling = read_scaling(check, grad_scale, found_inf, grad_factor);
  if (scaling.skip) return;  // before the step counters move
  bump_steps(steps);
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    const auto h = rmsprop_hyper<acc_t>(lr, alpha, eps, weight_decay, momentum, scaling.grad_factor);
    dispatch_bool(centered, [&](auto cen) {
      dispatch_bool(use_momentum, [&](auto mom) {
        parallel_over_elements(check.numels(), [&](size_t t, int64_t begin, int64_t end) {
          const grad_t* __restrict__ g = ptr<grad_t>(grads[t]);
          acc_t* __restrict__ sq = ptr<acc_t>(square_avgs[t]);
          acc_t* __restrict__ ga = cen ? ptr<acc_t>(grad_avgs[t]) : nullptr;
          acc_t* __restrict__ buf = mom ? ptr<acc_t>(momentum_buffers[t]) : nullptr;
          acc_t* master = args.has_master ? ptr<acc_t>(master_params[t]) : nullptr;
          update_params(ptr<param_t>(params[t]), master, begin, end, [&](acc_t& p, int64_t i) {
            acc_t a = cen ? ga[i] : acc_t(0);
            acc_t b = mom ? buf[i] : acc_t(0);
            rmsprop_element<acc_t, decltype(cen)::value, decltype(mom)::value>(p, static_cast<acc_t>(g[i]), sq[i], a,
                                                                               b, h);
            if (cen) ga[i] = a;
            if (mom) buf[i] = b;
          });
        });
      });
    });
    if (scaling.grad_scale != 0.0) unscale_grads<grad_t, acc_t>(grads, check.numels(), scaling.grad_scale);
  });
}

void rmsprop_tf_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList square_avgs,
                         at::TensorList grad_avgs, at::TensorList momentum_buffers, at::TensorList master_params,
                         at::TensorList steps, double lr, double alpha, double eps, double weight_decay,
                         double momentum, bool centered, bool decoupled_decay, bool lr_in_momentum,
                         double grad_factor,
                         const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf) {
  const ListChecker check("rmsprop_tf_step", params);
  const bool use_momentum = momentum > 0.0;
  const CheckedArgs args = check_rmsprop_args(check, grads, square_avgs, grad_avgs, momentum_buffers,
                                              master_params, steps, centered, use_momentum);
  const CpuScaling scaling = read_scaling(check, grad_scale, found_inf, grad_factor);
  if (scaling.skip) return;  // before the step counters move
  bump_steps(steps);
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    const auto h =
        rmsprop_tf_hyper<acc_t>(lr, alpha, eps, weight_decay, momentum, decoupled_decay, scaling.grad_factor);
    dispatch_bool(centered, [&](auto cen) {
      dispatch_bool(use_momentum, [&](auto mom) {
        dispatch_bool(lr_in_momentum, [&](auto lim) {
          parallel_over_elements(check.numels(), [&](size_t t, int64_t begin, int64_t end) {
            const grad_t* __restrict__ g = ptr<grad_t>(grads[t]);
            acc_t* __restrict__ sq = ptr<acc_t>(square_avgs[t]);
            acc_t* __restrict__ ga = cen ? ptr<acc_t>(grad_avgs[t]) : nullptr;
            acc_t* __restrict__ buf = mom ? ptr<acc_t>(momentum_buffers[t]) : nullptr;
            acc_t* master = args.has_master ? ptr<acc_t>(master_params[t]) : nullptr;
            update_params(ptr<param_t>(params[t]), master, begin, end, [&](acc_t& p, int64_t i) {
              acc_t a = cen ? ga[i] : acc_t(0);
              acc_t b = mom ? buf[i] : acc_t(0);
              rmsprop_tf_element<acc_t, decltype(cen)::value, decltype(mom)::value, decltype(lim)::value>(
                  p, static_cast<acc_t>(g[i]), sq[i], a, b, h);
              if (cen) ga[i] = a;
              if (mom) buf[i] = b;
            });
          });
        });
      });
    });
    if (scaling.grad_scale != 0.0) unscale_grads<grad_t, acc_t>(grads, check.numels(), scaling.grad_scale);
  });
}

void adadelta_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList square_avgs,
                       at::TensorList acc_deltas, at::TensorList master_params, at::TensorList steps, double lr,
                       double rho, double eps, double weight_decay, double grad_factor,
                       const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf) {
  const ListChecker check("adadelta_step", params);
  const CheckedArgs args = check_adadelta_args(check, grads, square_avgs, acc_deltas, master_params, steps);
  const CpuScaling scaling = read_scaling(check, grad_scale, found_inf, grad_factor);
  if (scaling.skip) return;  // before the step counters move
  bump_steps(steps);
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    const auto h = adadelta_hyper<acc_t>(lr, rho, eps, weight_decay, scaling.grad_factor);
    parallel_over_elements(check.numels(), [&](size_t t, int64_t begin, int64_t end) {
      const grad_t* __restrict__ g = ptr<grad_t>(grads[t]);
      acc_t* __restrict__ sq = ptr<acc_t>(square_avgs[t]);
      acc_t* __restrict__ ad = ptr<acc_t>(acc_deltas[t]);
      acc_t* master = args.has_master ? ptr<acc_t>(master_params[t]) : nullptr;
      update_params(ptr<param_t>(params[t]), master, begin, end, [&](acc_t& p, int64_t i) {
        adadelta_element<acc_t>(p, static_cast<acc_t>(g[i]), sq[i], ad[i], h);
      });
    });
    if (scaling.grad_scale != 0.0) unscale_grads<grad_t, acc_t>(grads, check.numels(), scaling.grad_scale);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(ampkit_optimizers, CompositeExplicitAutograd, m) {
  m.impl("adagrad_step", &adagrad_step_cpu);
  m.impl("rmsprop_step", &rmsprop_step_cpu);
  m.impl("rmsprop_tf_step", &rmsprop_tf_step_cpu);
  m.impl("adadelta_step", &adadelta_step_cpu);
}

}  // namespace optim
}  // namespace ampkit
