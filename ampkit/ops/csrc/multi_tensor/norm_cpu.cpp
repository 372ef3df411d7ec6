// CPU kernels of the multi-tensor L2 norms: l2norm, and unscale_l2norm (one read pass: inf check,
// norm of the unscaled values, optionally writing them). Float accumulation lane-wise inside a chunk
// (kLanes independent sums that gcc vectorizes without -ffast-math), double across chunks.
#include <ATen/ops/empty.h>

#include "common/accumulate.h"
#include "common/checks.h"
#include "common/dispatch.h"
#include "common/multi_tensor_cpu.h"
#include "multi_tensor/functors.h"
#include "multi_tensor/multi_tensor_checks.h"
#include "multi_tensor/multi_tensor_cpu.h"

#include <cmath>
#include <type_traits>
#include <vector>

namespace ampkit {
namespace {

using cpu::ChunkPlan;
using cpu::NonFiniteFlag;

using cpu::Segment;

constexpr int kLanes = 32;

// Sum of squares of x[i] * factor over n elements; with kCheck also reports a non-finite x, with
// kWrite also stores x[i] * factor to out. kInPlace (out == x, same dtype) reads through `out`, so
// gcc sees one pointer and vectorizes without a runtime alias check.
template <bool kCheck, bool kWrite, bool kInPlace, typename TI, typename TO>
double sum_squares_segment(const TI* x_arg, TO* out, int64_t n, acc_t<TI> factor, bool* nonfinite) {
  using A = acc_t<TI>;
  const TI* x = kInPlace ? reinterpret_cast<const TI*>(out) : x_arg;
  const ScaleOp<A> unscale{factor};
  A lanes[kLanes] = {};
  // Lane-wise non-finite probe: raw - raw is 0 for finite values and nan otherwise, so the probe
  // stays in vector registers (an int flag OR-reduced per block costs a horizontal reduction).
  A probe[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const A raw = static_cast<A>(x[i + j]);
      if (kCheck) probe[j] += raw - raw;
      const A v = unscale(raw);
      if (kWrite) out[i + j] = static_cast<TO>(v);
      lanes[j] += square(v);
    }
  }
  A tail = 0;
  bool bad = false;
  for (; i < n; ++i) {
    const A raw = static_cast<A>(x[i]);
    if (kCheck) bad |= is_nonfinite(raw);
    const A v = unscale(raw);
    if (kWrite) out[i] = static_cast<TO>(v);
    tail += square(v);
  }
  double total = tail;
  for (int j = 0; j < kLanes; ++j) {
    total += lanes[j];
    bad |= is_nonfinite(probe[j]);
  }
  if (kCheck) *nonfinite = bad;
  return total;
}

template <typename T>
bool any_nonfinite(const T* x, int64_t n) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= is_nonfinite(static_cast<acc_t<T>>(x[i]));
  return bad != 0;
}

// Shared body of both norms; `outputs` empty means "do not write".
std::tuple<at::Tensor, at::Tensor> norms(const char* op, at::TensorList inputs, at::TensorList outputs, double factor,
                                         const at::Tensor* found_inf, bool per_tensor, const at::Device& device) {
  const auto in = contiguous_inputs(inputs);
  OutputBuffers outs(outputs);
  const bool write = !outputs.empty();
  ChunkPlan plan(in);
  std::vector<double> partial(plan.segments().size());
  NonFiniteFlag flag;
  plan.parallel_for_each([&](int64_t index, const Segment& s) {
    const at::Tensor& x = in[s.tensor];
    const at::Tensor& o = write ? outs.tensors()[s.tensor] : x;
    dispatch_float(x.scalar_type(), op, [&](auto in_tag) {
      using TI = decltype(in_tag);
      const TI* xp = x.const_data_ptr<TI>() + s.begin;
      const auto f = static_cast<acc_t<TI>>(factor);
      bool bad = false;
      if (found_inf == nullptr) {
        partial[index] = sum_squares_segment<false, false, false, TI, TI>(xp, nullptr, s.length, f, &bad);
      } else if (!write) {
        // A non-finite input makes the sum of squares non-finite, so the plain norm loop runs and
        // only a non-finite sum (rare: an overflow or an inf) pays a second read to tell which.
        partial[index] = sum_squares_segment<false, false, false, TI, TI>(xp, nullptr, s.length, f, &bad);
        if (!std::isfinite(partial[index])) bad = any_nonfinite(xp, s.length);
      } else {
        dispatch_float(o.scalar_type(), op, [&](auto out_tag) {
          using TO = decltype(out_tag);
          TO* op = o.data_ptr<TO>() + s.begin;
          if constexpr (std::is_same_v<TI, TO>) {
            if (op == xp) {
              partial[index] = sum_squares_segment<true, true, true, TI, TO>(xp, op, s.length, f, &bad);
              return;
            }
          }
          partial[index] = sum_squares_segment<true, true, false, TI, TO>(xp, op, s.length, f, &bad);
        });
      }
      flag.note(bad);
    });
  });
  outs.finish();
  if (found_inf != nullptr) flag.publish(*found_inf);

  std::vector<double> per(in.size(), 0.0);
  for (size_t s = 0; s < partial.size(); ++s) per[plan.segments()[s].tensor] += partial[s];
  double total = 0.0;
  for (double v : per) total += v;
  const auto options = at::TensorOptions().dtype(norm_dtype(in)).device(device);
  at::Tensor total_norm = at::empty({}, options);
  at::Tensor per_norm = at::empty({per_tensor ? static_cast<int64_t>(in.size()) : 0}, options);
  dispatch_float(total_norm.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    *total_norm.data_ptr<T>() = static_cast<T>(std::sqrt(total));
    T* p = per_norm.data_ptr<T>();
    for (int64_t i = 0; i < per_norm.numel(); ++i) p[i] = static_cast<T>(std::sqrt(per[i]));
  });
  return {total_norm, per_norm};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> l2norm_cpu(at::TensorList inputs, bool per_tensor) {
  constexpr const char* op = "ampkit_multi_tensor.l2norm";
  const auto device = inputs.empty() ? at::Device(at::kCPU) : inputs[0].device();
  check_list(op, inputs, "inputs", device);
  return norms(op, inputs, {}, 1.0, nullptr, per_tensor, device);
}

std::tuple<at::Tensor, at::Tensor> unscale_l2norm_cpu(at::TensorList inputs, at::TensorList outputs, double inv_scale,
                                                      const at::Tensor& found_inf, bool per_tensor) {
  constexpr const char* op = "ampkit_multi_tensor.unscale_l2norm";
  check_unscale_l2norm_args(op, inputs, outputs, found_inf);
  const auto device = found_inf.device();
  return norms(op, inputs, outputs, inv_scale, &found_inf, per_tensor, device);
}

}  // namespace ampkit
