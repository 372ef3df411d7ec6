// First line of the translation unit, so every function shares the attribute and still inlines and
// vectorizes: no FMA contraction, to round like torch's element-wise ops (see optimizer_math.h).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
// Fused AdamP (clovaai/AdamP) over a tensor list (CPU). Per tensor of two or more dimensions, one pass
// updates the moments and sums, per row, what the projection test needs; the test picks a coefficient per
// row; a second pass recomputes the direction from the stored moments and applies it. Vectors and scalars
// (one dimension or none) are never projected and take a single pass.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_multi_tensor.h"
#include "hyper.h"
#include "op_checks.h"

namespace ampkit {
namespace optim {
namespace {

// One row's sums from the first pass: grad.weight, grad.grad, weight.weight and weight.direction.
struct RowSums {
  double gp = 0.0;
  double gg = 0.0;
  double pp = 0.0;
  double pq = 0.0;
};

// AdamP's choice for a tensor whose rows have `cols` elements: channel-wise (a coefficient per row) when every
// row's |cos(grad, weight)| is under delta / sqrt(cols), else layer-wise (one coefficient) when the whole
// tensor's is under delta / sqrt(numel), else no projection. Fills `coefs` and returns the weight-decay ratio.
double choose_projection(const std::vector<RowSums>& rows, int64_t cols, double delta, double wd_ratio, double eps,
                         std::vector<double>& coefs) {
  double max_cos = 0.0;
  RowSums total;
  for (const RowSums& r : rows) {
    max_cos = adamp_max_cosine(max_cos, adamp_abs_cosine(r.gp, r.gg, r.pp, eps));
    total.gp += r.gp;
    total.gg += r.gg;
    total.pp += r.pp;
    total.pq += r.pq;
  }
  coefs.assign(rows.size(), 0.0);
  const int choice = adamp_choice(max_cos, total.gp, total.gg, total.pp, static_cast<double>(rows.size()),
                                  static_cast<double>(cols), delta, eps);
  if (choice == 1) {
    for (size_t i = 0; i < rows.size(); ++i) coefs[i] = adamp_radial_coef(rows[i].pq, rows[i].pp, eps);
  } else if (choice == 2) {
    std::fill(coefs.begin(), coefs.end(), adamp_radial_coef(total.pq, total.pp, eps));
  }
  return choice != 0 ? wd_ratio : 1.0;
}

// One tensor's lists. Each pass copies the pointers into __restrict__ locals and the hyper-parameters into a
// local value, so the compiler knows the stores into the moments alias neither and can vectorize the loops.
template <typename param_t, typename grad_t, typename acc_t, bool NESTEROV>
struct AdamPTensor {
  param_t* param;
  acc_t* master;  // fp32 master copy or nullptr
  const grad_t* grad;
  acc_t* m;
  acc_t* v;
  AdamPHyper<acc_t> h;

  // Calls pass(load, store) with the weight read from and written to the master copy where there is one.
  template <class Pass>
  void with_weights(const Pass& pass) const {
    param_t* __restrict__ out = param;
    if (master != nullptr) {
      acc_t* __restrict__ w = master;
      pass([=](int64_t i) { return w[i]; }, [=](int64_t i, acc_t value) {
        w[i] = value;
        out[i] = static_cast<param_t>(value);
      });
    } else {
      pass([=](int64_t i) { return static_cast<acc_t>(out[i]); },
           [=](int64_t i, acc_t value) { out[i] = static_cast<param_t>(value); });
    }
  }

  // First pass over [begin, end): moments updated, sums of the projection test accumulated. The sums run in
  // kLanes independent partial sums (added up at the end), so the loop vectorizes without reordering any one sum.
  void moments(int64_t begin, int64_t end, RowSums& sums) const {
    with_weights([&](const auto& load, const auto&) {
      constexpr int kLanes = 8;
      const AdamPHyper<acc_t> hy = h;
      const grad_t* __restrict__ g = grad;
      acc_t* __restrict__ mm = m;
      acc_t* __restrict__ vv = v;
      double gp[kLanes] = {}, gg[kLanes] = {}, pp[kLanes] = {}, pq[kLanes] = {};
      const auto element = [&](int64_t i, int k) {
        const acc_t gi = static_cast<acc_t>(g[i]) * hy.grad_factor;
        const acc_t pi = load(i);
        const acc_t qi = adamp_moments<acc_t, NESTEROV>(gi, mm[i], vv[i], hy);
        gp[k] += static_cast<double>(gi) * static_cast<double>(pi);
        gg[k] += static_cast<double>(gi) * static_cast<double>(gi);
        pp[k] += static_cast<double>(pi) * static_cast<double>(pi);
        pq[k] += static_cast<double>(pi) * static_cast<double>(qi);
      };
      int64_t i = begin;
      for (; i + kLanes <= end; i += kLanes) {
        for (int k = 0; k < kLanes; ++k) element(i + k, k);
      }
      for (int k = 0; i < end; ++i, ++k) element(i, k);
      for (int k = 0; k < kLanes; ++k) {
        sums.gp += gp[k];
        sums.gg += gg[k];
        sums.pp += pp[k];
        sums.pq += pq[k];
      }
    });
  }

  // Second pass: the direction again (from the stored moments, the same bits), projected and applied.
  void apply(int64_t begin, int64_t end, acc_t coef, acc_t decay) const {
    with_weights([&](const auto& load, const auto& store) {
      const AdamPHyper<acc_t> hy = h;
      const grad_t* __restrict__ g = grad;
      const acc_t* __restrict__ mm = m;
      const acc_t* __restrict__ vv = v;
      for (int64_t i = begin; i < end; ++i) {
        acc_t pi = load(i);
        const acc_t gi = static_cast<acc_t>(g[i]) * hy.grad_factor;
        adamp_apply<acc_t>(pi, adamp_direction<acc_t, NESTEROV>(gi, mm[i], vv[i], hy), coef, decay, hy);
        store(i, pi);
      }
    });
  }

  // Vectors and scalars: one pass, never projected.
  void unprojected(int64_t begin, int64_t end, acc_t decay) const {
    with_weights([&](const auto& load, const auto& store) {
      const AdamPHyper<acc_t> hy = h;
      const grad_t* __restrict__ g = grad;
      acc_t* __restrict__ mm = m;
      acc_t* __restrict__ vv = v;
      for (int64_t i = begin; i < end; ++i) {
        acc_t pi = load(i);
        const acc_t gi = static_cast<acc_t>(g[i]) * hy.grad_factor;
        adamp_apply<acc_t>(pi, adamp_moments<acc_t, NESTEROV>(gi, mm[i], vv[i], hy), acc_t(0), decay, hy);
        store(i, pi);
      }
    });
  }
};

constexpr int64_t kGrain = int64_t(1) << 15;

void adamp_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList master_params, at::TensorList steps, double lr, double beta1, double beta2,
                    double eps, double weight_decay, double delta, double wd_ratio, bool nesterov,
                    double grad_factor) {
  const ListChecker check("adamp_step", params);
  const CheckedArgs args = check_adamp_args(check, grads, exp_avgs, exp_avg_sqs, master_params, steps);
  const std::vector<double> step = bump_steps(steps);
  // clovaai/AdamP decays only for weight_decay > 0, by lr * weight_decay * ratio (ratio = wd_ratio if projected).
  const auto decay_for = [&](double ratio) { return weight_decay > 0 ? 1.0 - lr * weight_decay * ratio : 1.0; };
  dispatch_param_grad(check.param_dtype(), args.grad_dtype, [&](auto ptag, auto gtag) {
    using param_t = typename decltype(ptag)::type;
    using grad_t = typename decltype(gtag)::type;
    using acc_t = acc_type_for<param_t>;
    dispatch_bool(nesterov, [&](auto nesterov_tag) {
      using Tensor = AdamPTensor<param_t, grad_t, acc_t, decltype(nesterov_tag)::value>;
      std::vector<RowSums> rows;
      std::vector<double> coefs;
      for (size_t t = 0; t < params.size(); ++t) {
        const int64_t numel = params[t].numel();
        if (numel == 0) continue;
        const auto h = adamp_hyper<acc_t>(step[t], lr, beta1, beta2, eps, grad_factor);
        const Tensor x{ptr<param_t>(params[t]), args.has_master ? ptr<acc_t>(master_params[t]) : nullptr,
                       ptr<grad_t>(grads[t]),   ptr<acc_t>(exp_avgs[t]),
                       ptr<acc_t>(exp_avg_sqs[t]), h};
        if (params[t].dim() <= 1) {
          const acc_t decay = static_cast<acc_t>(decay_for(1.0));
          at::parallel_for(0, numel, kGrain, [&](int64_t begin, int64_t end) { x.unprojected(begin, end, decay); });
          continue;
        }
        const int64_t n_rows = params[t].size(0);
        const int64_t cols = numel / n_rows;
        const int64_t grain = std::max<int64_t>(1, kGrain / cols);
        rows.assign(n_rows, RowSums{});
        at::parallel_for(0, n_rows, grain, [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) x.moments(r * cols, (r + 1) * cols, rows[r]);
        });
        const acc_t decay = static_cast<acc_t>(decay_for(choose_projection(rows, cols, delta, wd_ratio, eps, coefs)));
        at::parallel_for(0, n_rows, grain, [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) x.apply(r * cols, (r + 1) * cols, static_cast<acc_t>(coefs[r]), decay);
        });
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(ampkit_optimizers, CompositeExplicitAutograd, m) { m.impl("adamp_step", &adamp_step_cpu); }

}  // namespace optim
}  // namespace ampkit
