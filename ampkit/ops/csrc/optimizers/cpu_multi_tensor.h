// CPU loops shared by the optimizer kernels: a parallel loop over the concatenated elements of a tensor
// list (one at::parallel_for, split by element count so tiny and huge tensors balance) and the
// parameter load/store around each element update. Argument checks and dtype dispatch: list_checks.h.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
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

}  // namespace optim
}  // namespace ampkit
