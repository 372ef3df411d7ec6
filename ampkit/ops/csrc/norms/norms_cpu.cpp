// LayerNorm / RMSNorm forward and backward on CPU, registered as torch.ops.ampkit_norms.*.
//
// Rows (the flattened leading dimensions) are split across at::parallel_for; each row is read from
// memory once per pass kind and re-walked from cache for its statistics, so forward moves x in / y out
// and backward moves dy, x (or y) in / dx out. Half inputs accumulate in float, double in double.
// Weight and bias arrive as contiguous acc_t arrays (the caller converts them; they are tiny), and the
// weight/bias gradients are summed into one acc_t partial row per chunk of rows, reduced at the end.
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "norm_functors.h"

namespace ampkit {
namespace norms {
namespace {

using at::Tensor;

// Loops run on raw element types that gcc vectorizes: c10::Half and c10::BFloat16 convert through
// class temporaries that block vectorization, so half is read as _Float16 (vcvtph2ps) and bfloat16 as
// its uint16_t bits, rounded to nearest-even on store exactly as c10::BFloat16 does (NaN -> 0x7FC0).
template <typename T>
struct RawOf {
  using type = T;
};
template <>
struct RawOf<at::Half> {
  using type = _Float16;
};
template <>
struct RawOf<at::BFloat16> {
  using type = uint16_t;
};
template <typename T>
using raw_t = typename RawOf<T>::type;

inline float to_acc(float v) { return v; }
inline double to_acc(double v) { return v; }
inline float to_acc(_Float16 v) { return static_cast<float>(v); }
inline float to_acc(uint16_t bf16_bits) { return __builtin_bit_cast(float, static_cast<uint32_t>(bf16_bits) << 16); }

template <typename R>
inline R from_acc(float v) {
  return static_cast<R>(v);
}
template <>
inline uint16_t from_acc<uint16_t>(float v) {
  const uint32_t u = __builtin_bit_cast(uint32_t, v);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : static_cast<uint16_t>(rounded);
}
template <typename R>
inline R from_acc(double v) {
  return static_cast<R>(v);
}

template <typename T>
const raw_t<T>* raw(const T* p) {
  return reinterpret_cast<const raw_t<T>*>(p);
}
template <typename T>
raw_t<T>* raw(T* p) {
  return reinterpret_cast<raw_t<T>*>(p);
}

// Row sums with 16 independent accumulators: gcc vectorizes the fixed-width inner loop without
// -ffast-math (an OpenMP simd reduction here compiled to masked gathers, 2x slower). term(i, a, b)
// adds element i's contributions to the two accumulators a and b.
constexpr int64_t kLanes = 16;

template <typename acc_t, typename Term>
inline void row_sums(int64_t n, Term&& term, acc_t& sum_a, acc_t& sum_b) {
  acc_t a[kLanes] = {};
  acc_t b[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) term(i + j, a[j], b[j]);
  }
  acc_t tail_a = 0, tail_b = 0;
  for (; i < n; ++i) term(i, tail_a, tail_b);
  for (int64_t j = 0; j < kLanes; ++j) {
    tail_a += a[j];
    tail_b += b[j];
  }
  sum_a = tail_a;
  sum_b = tail_b;
}

// Rows per at::parallel_for task: enough work (~32K elements) to amortise the task overhead.
int64_t rows_grain(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

template <typename in_t, typename out_t, bool kRms>
void forward_rows(const in_t* x_, const at::opmath_type<in_t>* w, const at::opmath_type<in_t>* b, out_t* y_,
                  at::opmath_type<in_t>* mean_out, at::opmath_type<in_t>* rstd_out, int64_t rows, int64_t n,
                  double eps) {
  using acc_t = at::opmath_type<in_t>;
  using out_raw = raw_t<out_t>;
  const auto* x = raw(x_);
  auto* y = raw(y_);
  const acc_t inv_n = acc_t(1) / acc_t(n);
  const acc_t eps_acc = static_cast<acc_t>(eps);
  at::parallel_for(0, rows, rows_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto* __restrict xr = x + r * n;
      auto* __restrict yr = y + r * n;
      // Two passes over the (cached) row: mean, then the centred second moment, for stability.
      acc_t mean = 0, unused = 0, sq = 0;
      if constexpr (!kRms) {
        row_sums<acc_t>(n, [&](int64_t i, acc_t& s, acc_t&) { s += to_acc(xr[i]); }, mean, unused);
        mean *= inv_n;
      }
      row_sums<acc_t>(
          n,
          [&](int64_t i, acc_t& s, acc_t&) {
            const acc_t d = to_acc(xr[i]) - mean;
            s += d * d;
          },
          sq, unused);
      const acc_t rstd = rstd_from_variance(sq * inv_n, eps_acc);
      const NormForward<acc_t> f{mean, rstd};
      if constexpr (kRms) {
        for (int64_t i = 0; i < n; ++i) yr[i] = from_acc<out_raw>(f(to_acc(xr[i]), w[i], acc_t(0)));
      } else {
        mean_out[r] = mean;
        for (int64_t i = 0; i < n; ++i) yr[i] = from_acc<out_raw>(f(to_acc(xr[i]), w[i], b[i]));
      }
      rstd_out[r] = rstd;
    }
  });
}

// dx for one row, plus the row's contribution to the weight/bias gradient partials (either may be
// null). A function of its own so that __restrict holds and gcc vectorizes without alias checks.
template <typename acc_t, typename dy_raw, typename dx_raw>
inline void grad_row(const NormInputGrad<acc_t>& f, const dy_raw* __restrict dy, const acc_t* __restrict w,
                     const acc_t* __restrict xhat, dx_raw* __restrict dx, acc_t* __restrict dw,
                     acc_t* __restrict db, int64_t n) {
  if (dw && db) {
    for (int64_t i = 0; i < n; ++i) {
      const acc_t d = to_acc(dy[i]);
      dx[i] = from_acc<dx_raw>(f(d * w[i], xhat[i]));
      dw[i] += d * xhat[i];
      db[i] += d;
    }
  } else if (dw) {
    for (int64_t i = 0; i < n; ++i) {
      const acc_t d = to_acc(dy[i]);
      dx[i] = from_acc<dx_raw>(f(d * w[i], xhat[i]));
      dw[i] += d * xhat[i];
    }
  } else {
    for (int64_t i = 0; i < n; ++i) dx[i] = from_acc<dx_raw>(f(to_acc(dy[i]) * w[i], xhat[i]));
  }
}

// saved_t is in_t when xhat comes from the input, out_t when it comes from the output.
template <typename in_t, typename out_t, typename saved_t, bool kRms, bool kFromOutput>
void backward_rows(const out_t* dy_, const saved_t* saved_, const at::opmath_type<in_t>* mean,
                   const at::opmath_type<in_t>* rstd, const at::opmath_type<in_t>* w,
                   const at::opmath_type<in_t>* b, in_t* dx_, at::opmath_type<in_t>* dw_partial,
                   at::opmath_type<in_t>* db_partial, int64_t rows, int64_t n, int64_t chunks) {
  using acc_t = at::opmath_type<in_t>;
  const auto* dy = raw(dy_);
  const auto* saved = raw(saved_);
  auto* dx = raw(dx_);
  const acc_t inv_n = acc_t(1) / acc_t(n);
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    std::vector<acc_t> xhat_buf(n);
    acc_t* __restrict xhat = xhat_buf.data();
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      acc_t* __restrict dwp = dw_partial ? dw_partial + c * n : nullptr;
      acc_t* __restrict dbp = db_partial ? db_partial + c * n : nullptr;
      if (dwp) std::fill(dwp, dwp + n, acc_t(0));
      if (dbp) std::fill(dbp, dbp + n, acc_t(0));
      const int64_t row_begin = rows * c / chunks;
      const int64_t row_end = rows * (c + 1) / chunks;
      for (int64_t r = row_begin; r < row_end; ++r) {
        const auto* __restrict sr = saved + r * n;
        const auto* __restrict dyr = dy + r * n;
        auto* __restrict dxr = dx + r * n;
        const acc_t rs = rstd[r];
        // Pass 1 (row from memory): xhat into the cached scratch row, and the two row sums.
        acc_t sum_g = 0, sum_gxhat = 0;
        if constexpr (kFromOutput) {
          const NormalizedFromOutput<acc_t> fx{};
          row_sums<acc_t>(
              n,
              [&](int64_t i, acc_t& sg, acc_t& sgx) {
                const acc_t xh = fx(to_acc(sr[i]), w[i], kRms ? acc_t(0) : b[i]);
                const acc_t g = to_acc(dyr[i]) * w[i];
                xhat[i] = xh;
                sg += g;
                sgx += g * xh;
              },
              sum_g, sum_gxhat);
        } else {
          const NormalizedFromInput<acc_t> fx{kRms ? acc_t(0) : mean[r], rs};
          row_sums<acc_t>(
              n,
              [&](int64_t i, acc_t& sg, acc_t& sgx) {
                const acc_t xh = fx(to_acc(sr[i]));
                const acc_t g = to_acc(dyr[i]) * w[i];
                xhat[i] = xh;
                sg += g;
                sgx += g * xh;
              },
              sum_g, sum_gxhat);
        }
        // Pass 2 (dy from cache): dx, and this chunk's weight/bias gradient partials.
        const NormInputGrad<acc_t> f{rs, kRms ? acc_t(0) : sum_g * inv_n, sum_gxhat * inv_n};
        grad_row(f, dyr, w, xhat, dxr, dwp, dbp, n);
      }
    }
  });
}

// Product of the trailing dims of `input` named by normalized_shape (checked).
int64_t normalized_numel(const Tensor& input, at::IntArrayRef normalized_shape, const char* input_name) {
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK(k >= 1, "ampkit_norms: normalized_shape must name at least one dimension, got ", normalized_shape);
  TORCH_CHECK(input.dim() >= k, "ampkit_norms: ", input_name, " with shape ", input.sizes(),
              " has fewer dimensions than normalized_shape ", normalized_shape);
  TORCH_CHECK(input.sizes().slice(input.dim() - k).equals(normalized_shape), "ampkit_norms: normalized_shape ",
              normalized_shape, " does not match the trailing dimensions of ", input_name, " with shape ",
              input.sizes());
  int64_t n = 1;
  for (int64_t s : normalized_shape) n *= s;
  return n;
}

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

at::ScalarType acc_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// Parameter as a contiguous acc_t array (ones/zeros when absent), after checking shape/device/dtype.
Tensor param_as_acc(const std::optional<Tensor>& p, const char* name, const Tensor& input, int64_t n,
                    double fill) {
  const auto acc = acc_dtype(input.scalar_type());
  if (!p.has_value() || !p->defined()) {
    return fill == 0.0 ? at::zeros({n}, input.options().dtype(acc)) : at::ones({n}, input.options().dtype(acc));
  }
  TORCH_CHECK(p->device() == input.device(), "ampkit_norms: ", name, " is on ", p->device(), " but input is on ",
              input.device());
  TORCH_CHECK(p->numel() == n, "ampkit_norms: ", name, " has ", p->numel(), " elements, normalized_shape has ", n);
  TORCH_CHECK(p->scalar_type() == input.scalar_type() || p->scalar_type() == acc,
              "ampkit_norms: ", name, " dtype ", p->scalar_type(), " must be input's dtype ", input.scalar_type(),
              " or ", acc);
  return p->to(acc).contiguous();
}

// Chunks of rows for the backward pass: one per thread, each owning a partial dw/db row.
int64_t backward_chunks(int64_t rows, int64_t n) {
  const int64_t by_work = std::max<int64_t>(1, rows / rows_grain(n));
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), by_work));
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls body(TypeTag<in_t>{}, TypeTag<out_t>{}) for the supported (input, output) dtype pairs.
template <typename Body>
void dispatch_in_out(at::ScalarType in, at::ScalarType out, const char* op, Body&& body) {
  TORCH_CHECK(is_supported_float(in), op, ": input dtype ", in, " is not supported (float32, float64, float16, bfloat16)");
  TORCH_CHECK(out == in || (out == at::kFloat && (in == at::kHalf || in == at::kBFloat16)), op,
              ": output dtype ", out, " must be the input's dtype ", in, " or float32 for half inputs");
  switch (in) {
    case at::kFloat:
      return body(TypeTag<float>{}, TypeTag<float>{});
    case at::kDouble:
      return body(TypeTag<double>{}, TypeTag<double>{});
    case at::kHalf:
      return out == in ? body(TypeTag<at::Half>{}, TypeTag<at::Half>{}) : body(TypeTag<at::Half>{}, TypeTag<float>{});
    case at::kBFloat16:
      return out == in ? body(TypeTag<at::BFloat16>{}, TypeTag<at::BFloat16>{})
                       : body(TypeTag<at::BFloat16>{}, TypeTag<float>{});
    default:
      TORCH_CHECK(false, op, ": unreachable dtype ", in);
  }
}

template <bool kRms>
std::tuple<Tensor, Tensor, Tensor> norm_forward(const Tensor& input_, at::IntArrayRef normalized_shape,
                                                const std::optional<Tensor>& weight,
                                                const std::optional<Tensor>& bias, double eps,
                                                std::optional<at::ScalarType> out_dtype) {
  const char* op = kRms ? "ampkit_norms::rms_norm_fwd" : "ampkit_norms::layer_norm_fwd";
  const int64_t n = normalized_numel(input_, normalized_shape, "input");
  const Tensor input = input_.contiguous();
  const int64_t rows = n == 0 ? 0 : input.numel() / n;
  const auto in_type = input.scalar_type();
  const auto out_type = out_dtype.value_or(in_type);
  const auto acc = acc_dtype(in_type);
  Tensor out = at::empty(input.sizes(), input.options().dtype(out_type));
  Tensor mean = at::empty({kRms ? 0 : rows}, input.options().dtype(acc));
  Tensor rstd = at::empty({rows}, input.options().dtype(acc));
  TORCH_CHECK(is_supported_float(in_type), op, ": input dtype ", in_type,
              " is not supported (float32, float64, float16, bfloat16)");
  const Tensor w = param_as_acc(weight, "weight", input, n, 1.0);
  const Tensor b = kRms ? Tensor() : param_as_acc(bias, "bias", input, n, 0.0);
  if (rows == 0) return {out, mean, rstd};
  dispatch_in_out(in_type, out_type, op, [&](auto in_tag, auto out_tag) {
      using in_t = typename decltype(in_tag)::type;
      using out_t = typename decltype(out_tag)::type;
    using acc_t = at::opmath_type<in_t>;
    forward_rows<in_t, out_t, kRms>(input.const_data_ptr<in_t>(), w.const_data_ptr<acc_t>(),
                                    kRms ? nullptr : b.const_data_ptr<acc_t>(), out.mutable_data_ptr<out_t>(),
                                    kRms ? nullptr : mean.mutable_data_ptr<acc_t>(),
                                    rstd.mutable_data_ptr<acc_t>(), rows, n, eps);
  });
  return {out, mean, rstd};
}

template <bool kRms>
std::tuple<Tensor, Tensor, Tensor> norm_backward(const Tensor& grad_out_, const Tensor& saved_, const Tensor& mean,
                                                 const Tensor& rstd, at::IntArrayRef normalized_shape,
                                                 const std::optional<Tensor>& weight,
                                                 const std::optional<Tensor>& bias, bool memory_efficient,
                                                 at::ScalarType input_dtype) {
  const char* op = kRms ? "ampkit_norms::rms_norm_bwd" : "ampkit_norms::layer_norm_bwd";
  const int64_t n = normalized_numel(saved_, normalized_shape, memory_efficient ? "output" : "input");
  TORCH_CHECK(grad_out_.sizes().equals(saved_.sizes()), op, ": grad_output shape ", grad_out_.sizes(),
              " differs from the saved tensor's ", saved_.sizes());
  const Tensor grad_out = grad_out_.contiguous();
  const Tensor saved = saved_.contiguous();
  const int64_t rows = n == 0 ? 0 : saved.numel() / n;
  const auto out_type = grad_out.scalar_type();
  TORCH_CHECK(!memory_efficient || saved.scalar_type() == out_type, op, ": saved output dtype ",
              saved.scalar_type(), " differs from grad_output dtype ", out_type);
  TORCH_CHECK(memory_efficient || saved.scalar_type() == input_dtype, op, ": saved input dtype ",
              saved.scalar_type(), " differs from input_dtype ", input_dtype);
  TORCH_CHECK(is_supported_float(input_dtype), op, ": input dtype ", input_dtype, " is not supported");
  const auto acc = acc_dtype(input_dtype);
  TORCH_CHECK(rstd.scalar_type() == acc && rstd.numel() == rows && rstd.is_contiguous(), op,
              ": rstd must be a contiguous ", acc, " tensor of ", rows, " elements");
  TORCH_CHECK(kRms || memory_efficient || (mean.scalar_type() == acc && mean.numel() == rows && mean.is_contiguous()),
              op, ": mean must be a contiguous ", acc, " tensor of ", rows, " elements");
  // param_as_acc checks dtypes against a tensor of the input's dtype and device.
  const Tensor like_input = at::empty({0}, saved.options().dtype(input_dtype));
  const bool affine = weight.has_value() && weight->defined();
  const bool has_bias = !kRms && bias.has_value() && bias->defined();
  const Tensor w = param_as_acc(weight, "weight", like_input, n, 1.0);
  const Tensor b = kRms ? Tensor() : param_as_acc(bias, "bias", like_input, n, 0.0);
  Tensor dx = at::empty(saved.sizes(), saved.options().dtype(input_dtype));
  const int64_t chunks = backward_chunks(rows, n);
  Tensor dw_partial = affine ? at::empty({chunks, n}, saved.options().dtype(acc)) : Tensor();
  Tensor db_partial = has_bias ? at::empty({chunks, n}, saved.options().dtype(acc)) : Tensor();
  if (rows > 0) {
    dispatch_in_out(input_dtype, out_type, op, [&](auto in_tag, auto out_tag) {
      using in_t = typename decltype(in_tag)::type;
      using out_t = typename decltype(out_tag)::type;
      using acc_t = at::opmath_type<in_t>;
      const acc_t* mean_ptr = (kRms || memory_efficient) ? nullptr : mean.const_data_ptr<acc_t>();
      acc_t* dwp = affine ? dw_partial.mutable_data_ptr<acc_t>() : nullptr;
      acc_t* dbp = has_bias ? db_partial.mutable_data_ptr<acc_t>() : nullptr;
      const acc_t* b_ptr = kRms ? nullptr : b.const_data_ptr<acc_t>();
      if (memory_efficient) {
        backward_rows<in_t, out_t, out_t, kRms, true>(grad_out.const_data_ptr<out_t>(), saved.const_data_ptr<out_t>(),
                                                      mean_ptr, rstd.const_data_ptr<acc_t>(), w.const_data_ptr<acc_t>(),
                                                      b_ptr, dx.mutable_data_ptr<in_t>(), dwp, dbp, rows, n, chunks);
      } else {
        backward_rows<in_t, out_t, in_t, kRms, false>(grad_out.const_data_ptr<out_t>(), saved.const_data_ptr<in_t>(),
                                                      mean_ptr, rstd.const_data_ptr<acc_t>(), w.const_data_ptr<acc_t>(),
                                                      b_ptr, dx.mutable_data_ptr<in_t>(), dwp, dbp, rows, n, chunks);
      }
    });
  }
  Tensor dw, db;
  if (affine) {
    dw = (rows > 0 ? at::sum(dw_partial, {0}) : at::zeros({n}, w.options())).to(weight->scalar_type());
    dw = dw.view(weight->sizes());
  }
  if (has_bias) {
    db = (rows > 0 ? at::sum(db_partial, {0}) : at::zeros({n}, w.options())).to(bias->scalar_type());
    db = db.view(bias->sizes());
  }
  return {dx, dw, db};
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_fwd(const Tensor& input, at::IntArrayRef normalized_shape,
                                                  const std::optional<Tensor>& weight,
                                                  const std::optional<Tensor>& bias, double eps,
                                                  std::optional<at::ScalarType> out_dtype) {
  return norm_forward<false>(input, normalized_shape, weight, bias, eps, out_dtype);
}

std::tuple<Tensor, Tensor> rms_norm_fwd(const Tensor& input, at::IntArrayRef normalized_shape,
                                        const std::optional<Tensor>& weight, double eps,
                                        std::optional<at::ScalarType> out_dtype) {
  auto [out, mean, rstd] = norm_forward<true>(input, normalized_shape, weight, std::nullopt, eps, out_dtype);
  return {out, rstd};
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_bwd(const Tensor& grad_out, const Tensor& saved, const Tensor& mean,
                                                  const Tensor& rstd, at::IntArrayRef normalized_shape,
                                                  const std::optional<Tensor>& weight,
                                                  const std::optional<Tensor>& bias, bool memory_efficient,
                                                  at::ScalarType input_dtype) {
  return norm_backward<false>(grad_out, saved, mean, rstd, normalized_shape, weight, bias, memory_efficient,
                              input_dtype);
}

std::tuple<Tensor, Tensor> rms_norm_bwd(const Tensor& grad_out, const Tensor& saved, const Tensor& rstd,
                                        at::IntArrayRef normalized_shape, const std::optional<Tensor>& weight,
                                        bool memory_efficient, at::ScalarType input_dtype) {
  auto [dx, dw, db] = norm_backward<true>(grad_out, saved, Tensor(), rstd, normalized_shape, weight, std::nullopt,
                                          memory_efficient, input_dtype);
  return {dx, dw};
}

}  // namespace

TORCH_LIBRARY(ampkit_norms, m) {
  m.def(
      "layer_norm_fwd(Tensor input, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps, "
      "ScalarType? out_dtype) -> (Tensor out, Tensor mean, Tensor rstd)");
  m.def(
      "layer_norm_bwd(Tensor grad_out, Tensor saved, Tensor mean, Tensor rstd, int[] normalized_shape, "
      "Tensor? weight, Tensor? bias, bool memory_efficient, ScalarType input_dtype) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  m.def(
      "rms_norm_fwd(Tensor input, int[] normalized_shape, Tensor? weight, float eps, ScalarType? out_dtype) "
      "-> (Tensor out, Tensor rstd)");
  m.def(
      "rms_norm_bwd(Tensor grad_out, Tensor saved, Tensor rstd, int[] normalized_shape, Tensor? weight, "
      "bool memory_efficient, ScalarType input_dtype) -> (Tensor grad_input, Tensor grad_weight)");
}

TORCH_LIBRARY_IMPL(ampkit_norms, CPU, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd);
  m.impl("layer_norm_bwd", &layer_norm_bwd);
  m.impl("rms_norm_fwd", &rms_norm_fwd);
  m.impl("rms_norm_bwd", &rms_norm_bwd);
}

}  // namespace norms
}  // namespace ampkit
