// First line of the translation unit, so every function shares the attribute and still inlines and
// vectorizes: no FMA contraction, to round like torch.optim (see optimizer_math.h).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
// Fused LAMB (two stages around per-tensor norms) and NovoGrad element updates over tensor lists (CPU).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_multi_tensor.h"
#include "optimizer_math.h"

namespace ampkit {
namespace optim {
namespace {

// Stage 1: update the moments and write the raw LAMB direction into `updates` (fp32/fp64 buffers).
void lamb_stage1_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList updates, at::TensorList master_params,
                     at::TensorList steps, double beta1, double beta2, double eps, double weight_decay,
                     bool adam_w_mode, bool grad_averaging, bool bias_correction, double grad_factor) {
  const ListChecker check("lamb_stage1", params);
  const at::ScalarType grad_dtype = check.grads(grads);
  check.state("exp_avgs", exp_avgs);
  check.state("exp_avg_sqs", exp_avg_sqs);
  check.state("updates", updates);
  const bool has_master = check.master(master_params);
  check.steps(steps);
  std::vector<LambHyper<double>> hyper(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const double step = bump_step(steps[i]);
    hyper[i] = {grad_factor,
                beta1,
                beta2,
                grad_averaging ? 1.0 - beta1 : 1.0,
                1.0 - beta2,
                eps,
                weight_decay,
                bias_correction ? 1.0 - std::pow(beta1, step) : 1.0,
                bias_correction ? 1.0 - std::pow(beta2, step) : 1.0};
  }
  dispatch_param_grad(check.param_dtype(), grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    dispatch_bool(adam_w_mode, [&](auto adamw) {
      parallel_over_elements(check.numels(), [&](size_t t, int64_t begin, int64_t end) {
        const LambHyper<double>& hd = hyper[t];
        const LambHyper<acc_t> h{acc_t(hd.grad_factor),     acc_t(hd.beta1),           acc_t(hd.beta2),
                                 acc_t(hd.beta3),           acc_t(hd.one_minus_beta2), acc_t(hd.eps),
                                 acc_t(hd.weight_decay),    acc_t(hd.bias_correction1),
                                 acc_t(hd.bias_correction2)};
        const param_t* __restrict__ p = ptr<param_t>(params[t]);
        const acc_t* __restrict__ master = has_master ? ptr<acc_t>(master_params[t]) : nullptr;
        const grad_t* __restrict__ g = ptr<grad_t>(grads[t]);
        acc_t* __restrict__ m = ptr<acc_t>(exp_avgs[t]);
        acc_t* __restrict__ v = ptr<acc_t>(exp_avg_sqs[t]);
        acc_t* __restrict__ u = ptr<acc_t>(updates[t]);
        for (int64_t i = begin; i < end; ++i) {
          const acc_t pv = master != nullptr ? master[i] : static_cast<acc_t>(p[i]);
          lamb_stage1_element<acc_t, decltype(adamw)::value>(pv, static_cast<acc_t>(g[i]), m[i], v[i], u[i], h);
        }
      });
    });
  });
}

// Stage 2: param -= ratios[t] * update, with ratios (float64 [n]) = lr x trust ratio per tensor.
void lamb_stage2_cpu(at::TensorList params, at::TensorList updates, at::TensorList master_params,
                     const at::Tensor& ratios) {
  const ListChecker check("lamb_stage2", params);
  check.state("updates", updates);
  const bool has_master = check.master(master_params);
  TORCH_CHECK(ratios.device().is_cpu() && ratios.scalar_type() == at::kDouble && ratios.dim() == 1 &&
                  ratios.numel() == static_cast<int64_t>(params.size()) && ratios.is_contiguous(),
              "lamb_stage2: ratios must be a contiguous float64 CPU vector with one entry per param (",
              params.size(), "); got ", ratios.scalar_type(), " of shape ", ratios.sizes());
  const double* r = ratios.data_ptr<double>();
  dispatch_param_grad(check.param_dtype(), check.param_dtype(), [&](auto ptag, auto) {
    using param_t = typename decltype(ptag)::type;
    using acc_t = acc_type_for<param_t>;
    parallel_over_elements(check.numels(), [&](size_t t, int64_t begin, int64_t end) {
      const acc_t ratio = static_cast<acc_t>(r[t]);
      const acc_t* __restrict__ u = ptr<acc_t>(updates[t]);
      acc_t* master = has_master ? ptr<acc_t>(master_params[t]) : nullptr;
      update_params(ptr<param_t>(params[t]), master, begin, end, [&](acc_t& p, int64_t i) { p = p - ratio * u[i]; });
    });
  });
}

// NovoGrad element update; denoms (float64 [n]) holds each tensor's blended grad norm / sqrt(bc2) + eps.
void novograd_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList master_params, const at::Tensor& denoms, double lr, double beta1,
                       double weight_decay, bool reg_inside_moment, bool grad_averaging, double bias_correction1,
                       double grad_factor) {
  const ListChecker check("novograd_step", params);
  const at::ScalarType grad_dtype = check.grads(grads);
  check.state("exp_avgs", exp_avgs);
  const bool has_master = check.master(master_params);
  TORCH_CHECK(denoms.device().is_cpu() && denoms.scalar_type() == at::kDouble && denoms.dim() == 1 &&
                  denoms.numel() == static_cast<int64_t>(params.size()) && denoms.is_contiguous(),
              "novograd_step: denoms must be a contiguous float64 CPU vector with one entry per param (",
              params.size(), "); got ", denoms.scalar_type(), " of shape ", denoms.sizes());
  const double* d = denoms.data_ptr<double>();
  dispatch_param_grad(check.param_dtype(), grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    dispatch_bool(!reg_inside_moment, [&](auto outside) {
      parallel_over_elements(check.numels(), [&](size_t t, int64_t begin, int64_t end) {
        const NovoGradHyper<acc_t> h{acc_t(grad_factor),
                                     acc_t(lr),
                                     acc_t(beta1),
                                     acc_t(grad_averaging ? 1.0 - beta1 : 1.0),
                                     acc_t(weight_decay),
                                     acc_t(bias_correction1),
                                     acc_t(d[t])};
        const grad_t* __restrict__ g = ptr<grad_t>(grads[t]);
        acc_t* __restrict__ m = ptr<acc_t>(exp_avgs[t]);
        acc_t* master = has_master ? ptr<acc_t>(master_params[t]) : nullptr;
        update_params(ptr<param_t>(params[t]), master, begin, end, [&](acc_t& p, int64_t i) {
          novograd_element<acc_t, decltype(outside)::value>(p, static_cast<acc_t>(g[i]), m[i], h);
        });
      });
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(ampkit_optimizers, CompositeExplicitAutograd, m) {
  m.impl("lamb_stage1", &lamb_stage1_cpu);
  m.impl("lamb_stage2", &lamb_stage2_cpu);
  m.impl("novograd_step", &novograd_step_cpu);
}

}  // namespace optim
}  // namespace ampkit
