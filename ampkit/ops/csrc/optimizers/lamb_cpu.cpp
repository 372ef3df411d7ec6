// First line of the translation unit, so every function shares the attribute and still inlines and
// vectorizes: no FMA contraction, to round like torch.optim (see optimizer_math.h).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
// Fused LAMB (two stages around per-tensor norms) and NovoGrad element updates over tensor lists (CPU).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_multi_tensor.h"
#include "hyper.h"
#include "op_checks.h"

namespace ampkit {
namespace optim {
namespace {

// Stage 1: update the moments and write the raw LAMB direction into `updates` (fp32/fp64 buffers).
void lamb_stage1_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList updates, at::TensorList master_params,
                     at::TensorList steps, double beta1, double beta2, double eps, double weight_decay,
                     bool adam_w_mode, bool grad_averaging, bool bias_correction, double grad_factor) {
  const ListChecker check("lamb_stage1", params);
  const CheckedArgs args = check_lamb_stage1_args(check, grads, exp_avgs, exp_avg_sqs, updates, master_params, steps);
  const std::vector<double> step = bump_steps(steps);
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    std::vector<LambHyper<acc_t>> hyper;
    for (const double s : step) {
      hyper.push_back(
          lamb_hyper<acc_t>(s, beta1, beta2, eps, weight_decay, grad_averaging, bias_correction, grad_factor));
    }
    dispatch_bool(adam_w_mode, [&](auto adamw) {
      parallel_over_elements(check.numels(), [&](size_t t, int64_t begin, int64_t end) {
        const LambHyper<acc_t>& h = hyper[t];
        const param_t* __restrict__ p = ptr<param_t>(params[t]);
        const acc_t* __restrict__ master = args.has_master ? ptr<acc_t>(master_params[t]) : nullptr;
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
  const double* r = per_tensor_values("lamb_stage2", "ratios", ratios, params.size());
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
  const CheckedArgs args = check_novograd_args(check, grads, exp_avgs, master_params);
  const double* d = per_tensor_values("novograd_step", "denoms", denoms, params.size());
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    dispatch_bool(!reg_inside_moment, [&](auto outside) {
      parallel_over_elements(check.numels(), [&](size_t t, int64_t begin, int64_t end) {
        const auto h =
            novograd_hyper<acc_t>(d[t], lr, beta1, weight_decay, grad_averaging, bias_correction1, grad_factor);
        const grad_t* __restrict__ g = ptr<grad_t>(grads[t]);
        acc_t* __restrict__ m = ptr<acc_t>(exp_avgs[t]);
        acc_t* master = args.has_master ? ptr<acc_t>(master_params[t]) : nullptr;
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
