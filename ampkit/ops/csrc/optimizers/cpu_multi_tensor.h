// CPU loops shared by the optimizer kernels: a parallel loop over the concatenated elements of a tensor
// list (one at::parallel_for, split by element count so tiny and huge tensors balance) and the
// parameter load/store around each element update. Argument checks and dtype dispatch: list_checks.h.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "optimizers/list_checks.h"

namespace ampkit {
namespace optim {

// Calls f(tensor_index, begin, end) on disjoint element ranges that cover every tensor, in parallel.
template <class F>
void parallel_over_elements(const std::vector<int64_t>& numels, const F& f) {
  std::vector<int64_t> offsets(numels.size() + 1, 0);
  for (size_t i = 0; i < numels.size(); ++i) offsets[i + 1] = offsets[i] + numels[i];
  const int64_t total = offsets.back();
  if (total == 0) return;
  constexpr int64_t kGrain = int64_t(1) << 15;
  at::parallel_for(0, total, kGrain, [&](int64_t begin, int64_t end) {
    size_t t = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
    while (begin < end) {
      while (offsets[t + 1] <= begin) ++t;
      const int64_t stop = std::min(end, offsets[t + 1]);
      f(t, begin - offsets[t], stop - offsets[t]);
      begin = stop;
    }
  });
}

// Runs body(acc_t& param_value, i) for i in [begin, end), loading the parameter from its fp32 master
// copy when there is one, and storing the result back to the master and the (possibly half) parameter.
template <typename param_t, typename acc_t, class Body>
inline void update_params(param_t* __restrict__ param, acc_t* __restrict__ master, int64_t begin, int64_t end,
                          const Body& body) {
  if (master != nullptr) {
    for (int64_t i = begin; i < end; ++i) {
      acc_t p = master[i];
      body(p, i);
      master[i] = p;
      param[i] = static_cast<param_t>(p);
    }
  } else {
    for (int64_t i = begin; i < end; ++i) {
      acc_t p = static_cast<acc_t>(param[i]);
      body(p, i);
      param[i] = static_cast<param_t>(p);
    }
  }
}

// torch's GradScaler contract read by a CPU kernel (the tensors sit in host memory, so reading them costs
// nothing): skip the whole step when found_inf is non-zero; otherwise fold 1 / grad_scale into the factor the
// kernel multiplies each gradient by, and divide the gradients by grad_scale in place afterwards.
struct CpuScaling {
  bool skip;
  double grad_factor;
  double grad_scale;  // 0 when no grad_scale was given: the gradients are left as they are
};

// Checks both tensors (ListChecker::scaling) before it reads them.
inline CpuScaling read_scaling(const ListChecker& check, const std::optional<at::Tensor>& grad_scale,
                               const std::optional<at::Tensor>& found_inf, double grad_factor) {
  check.scaling(grad_scale, found_inf);
  const bool skip = found_inf.has_value() && *static_cast<const float*>(found_inf->data_ptr()) != 0.0f;
  const double scale = grad_scale.has_value() ? *static_cast<const float*>(grad_scale->data_ptr()) : 0.0;
  return {skip, scale != 0.0 ? grad_factor / scale : grad_factor, scale};
}

// grads[t][i] = grads[t][i] / scale in the accumulate type, as torch._foreach_div_ by a float32 scalar tensor
// rounds it: what torch's fused optimizers leave in .grad after a GradScaler step.
template <typename grad_t, typename acc_t>
void unscale_grads(at::TensorList grads, const std::vector<int64_t>& numels, double scale) {
  const acc_t s = static_cast<acc_t>(static_cast<float>(scale));
  parallel_over_elements(numels, [&](size_t t, int64_t begin, int64_t end) {
    grad_t* __restrict__ g = ptr<grad_t>(grads[t]);
    for (int64_t i = begin; i < end; ++i) g[i] = static_cast<grad_t>(static_cast<acc_t>(g[i]) / s);
  });
}

}  // namespace optim
}  // namespace ampkit
