// First line of the translation unit, so every function shares the attribute and still inlines and
// vectorizes: no FMA contraction, to round like torch.optim (see optimizer_math.h).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
// Fused Adam/AdamW step over a list of tensors (CPU): one pass reading param, grad and both moments.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_multi_tensor.h"
#include "optimizer_math.h"

namespace ampkit {
namespace optim {
namespace {

void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList master_params,
                   at::TensorList steps, double lr, double beta1, double beta2, double eps, double weight_decay,
                   bool adam_w_mode, bool amsgrad, bool bias_correction, double grad_factor) {
  const ListChecker check("adam_step", params);
  const at::ScalarType grad_dtype = check.grads(grads);
  check.state("exp_avgs", exp_avgs);
  check.state("exp_avg_sqs", exp_avg_sqs);
  check.optional_state("max_exp_avg_sqs", max_exp_avg_sqs, amsgrad);
  const bool has_master = check.master(master_params);
  check.steps(steps);

  std::vector<AdamHyper<double>> hyper(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const double step = bump_step(steps[i]);
    const double bc1 = bias_correction ? 1.0 - std::pow(beta1, step) : 1.0;
    const double bc2 = bias_correction ? 1.0 - std::pow(beta2, step) : 1.0;
    hyper[i] = {grad_factor,  beta1,        beta2, 1.0 - beta1, 1.0 - beta2, eps, weight_decay,
                1.0 - lr * weight_decay, lr / bc1, std::sqrt(bc2)};
  }

  dispatch_param_grad(check.param_dtype(), grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    dispatch_bool(adam_w_mode, [&](auto adamw) {
      dispatch_bool(amsgrad, [&](auto ams) {
        parallel_over_elements(check.numels(), [&](size_t t, int64_t begin, int64_t end) {
          const AdamHyper<double>& hd = hyper[t];
          const AdamHyper<acc_t> h{acc_t(hd.grad_factor),     acc_t(hd.beta1),        acc_t(hd.beta2),
                                   acc_t(hd.one_minus_beta1), acc_t(hd.one_minus_beta2), acc_t(hd.eps),
                                   acc_t(hd.weight_decay),    acc_t(hd.decay_factor), acc_t(hd.step_size),
                                   acc_t(hd.bias_correction2_sqrt)};
          const grad_t* __restrict__ g = ptr<grad_t>(grads[t]);
          acc_t* __restrict__ m = ptr<acc_t>(exp_avgs[t]);
          acc_t* __restrict__ v = ptr<acc_t>(exp_avg_sqs[t]);
          acc_t* __restrict__ vmax = ams ? ptr<acc_t>(max_exp_avg_sqs[t]) : v;
          acc_t* master = has_master ? ptr<acc_t>(master_params[t]) : nullptr;
          update_params(ptr<param_t>(params[t]), master, begin, end, [&](acc_t& p, int64_t i) {
            acc_t vm = ams ? vmax[i] : acc_t(0);
            adam_element<acc_t, decltype(adamw)::value, decltype(ams)::value>(p, static_cast<acc_t>(g[i]), m[i],
                                                                              v[i], vm, h);
            if (ams) vmax[i] = vm;
          });
        });
      });
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(ampkit_optimizers, CompositeExplicitAutograd, m) { m.impl("adam_step", &adam_step_cpu); }

}  // namespace optim
}  // namespace ampkit
