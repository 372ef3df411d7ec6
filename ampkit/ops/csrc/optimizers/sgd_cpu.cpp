// First line of the translation unit, so every function shares the attribute and still inlines and
// vectorizes: no FMA contraction, to round like torch.optim (see optimizer_math.h).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
// Fused SGD step (momentum, dampening, Nesterov, weight decay) over a list of tensors (CPU).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_multi_tensor.h"
#include "optimizer_math.h"

namespace ampkit {
namespace optim {
namespace {

void sgd_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                  at::TensorList master_params, double lr, double weight_decay, double momentum, double dampening,
                  bool nesterov, bool first_step, double grad_factor) {
  const ListChecker check("sgd_step", params);
  const at::ScalarType grad_dtype = check.grads(grads);
  const bool use_momentum = momentum != 0.0;
  check.optional_state("momentum_buffers", momentum_buffers, use_momentum);
  const bool has_master = check.master(master_params);

  dispatch_param_grad(check.param_dtype(), grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    const SGDHyper<acc_t> h{acc_t(grad_factor), acc_t(lr), acc_t(weight_decay), acc_t(momentum),
                            acc_t(1.0 - dampening)};
    dispatch_bool(use_momentum, [&](auto mom) {
      dispatch_bool(nesterov, [&](auto nest) {
        dispatch_bool(first_step, [&](auto first) {
          parallel_over_elements(check.numels(), [&](size_t t, int64_t begin, int64_t end) {
            const grad_t* __restrict__ g = ptr<grad_t>(grads[t]);
            acc_t* __restrict__ buf = mom ? ptr<acc_t>(momentum_buffers[t]) : nullptr;
            acc_t* master = has_master ? ptr<acc_t>(master_params[t]) : nullptr;
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
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(ampkit_optimizers, CompositeExplicitAutograd, m) { m.impl("sgd_step", &sgd_step_cpu); }

}  // namespace optim
}  // namespace ampkit
