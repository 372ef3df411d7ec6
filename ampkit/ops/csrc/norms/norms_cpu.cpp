// LayerNorm / RMSNorm forward and backward on CPU, registered as torch.ops.ampkit_norms.*.
//
// Rows (the flattened leading dimensions) are split across at::parallel_for; each row is read from
// memory once per pass kind and re-walked from cache for its statistics, so forward moves x in / y out
// and backward moves dy, x (or y) in / dx out. Half inputs accumulate in float, double in double.
// Weight and bias arrive as contiguous acc_t arrays (the caller converts them; they are tiny), and the
// weight/bias gradients are summed into one acc_t partial row per chunk of rows, reduced at the end.
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "norm_functors.h"
#include "norm_ops.h"

namespace ampkit {
namespace norms {
namespace {

// Loops run on raw element types: c10::Half and c10::BFloat16 convert through class temporaries that
// block vectorization, so bfloat16 is handled as its uint16_t bits (vectorized; rounded to nearest-even
// on store exactly as c10::BFloat16 does, NaN -> 0x7FC0) and half as HalfBits, converted with F16C's
// vcvtph2ps/vcvtps2ph (exact, round to nearest-even). Not as _Float16: gcc 12 converts that with
// AVX512-FP16's scalar vcvtsh2ss/vcvtss2sh, which merge into their destination register and so chain
// every element of a row on the one before (measured 7.4 ns an element against 1.5 for F16C here).
#if defined(__F16C__)
struct HalfBits {
  uint16_t bits;
};
#else
using HalfBits = _Float16;
#endif
template <typename T>
struct RawOf {
  using type = T;
};
template <>
struct RawOf<at::Half> {
  using type = HalfBits;
};
template <>
struct RawOf<at::BFloat16> {
  using type = uint16_t;
};
template <typename T>
using raw_t = typename RawOf<T>::type;

inline float to_acc(float v) { return v; }
inline double to_acc(double v) { return v; }
#if defined(__F16C__)
inline float to_acc(HalfBits v) { return _cvtsh_ss(v.bits); }
#else
inline float to_acc(_Float16 v) { return static_cast<float>(v); }
#endif
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
#if defined(__F16C__)
template <>
inline HalfBits from_acc<HalfBits>(float v) {
  return HalfBits{_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT)};
}
#endif
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
template <typename acc_t, typename dy_raw, typename dx_raw, typename Xhat>
inline void grad_row(const NormInputGrad<acc_t>& f, const dy_raw* __restrict dy, const acc_t* __restrict w,
                     Xhat&& xhat, dx_raw* __restrict dx, acc_t* __restrict dw, acc_t* __restrict db, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] = from_acc<dx_raw>(f(to_acc(dy[i]) * w[i], xhat(i)));
  if (dw && db) {
    for (int64_t i = 0; i < n; ++i) {
      const acc_t d = to_acc(dy[i]);
      dw[i] += d * xhat(i);
      db[i] += d;
    }
  } else if (dw) {
    for (int64_t i = 0; i < n; ++i) dw[i] += to_acc(dy[i]) * xhat(i);
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
        // xhat of element i, recomputed from the saved row (in cache after pass 1) where needed.
        const auto xhat = [&](int64_t i) {
          if constexpr (kFromOutput) {
            return NormalizedFromOutput<acc_t>{}(to_acc(sr[i]), w[i], kRms ? acc_t(0) : b[i]);
          } else {
            return NormalizedFromInput<acc_t>{kRms ? acc_t(0) : mean[r], rs}(to_acc(sr[i]));
          }
        };
        // Pass 1 (rows from memory): the two row sums.
        acc_t sum_g = 0, sum_gxhat = 0;
        row_sums<acc_t>(
            n,
            [&](int64_t i, acc_t& sg, acc_t& sgx) {
              const acc_t g = to_acc(dyr[i]) * w[i];
              sg += g;
              sgx += g * xhat(i);
            },
            sum_g, sum_gxhat);
        // Pass 2 (rows from cache): dx, and this chunk's weight/bias gradient partials.
        const NormInputGrad<acc_t> f{rs, kRms ? acc_t(0) : sum_g * inv_n, sum_gxhat * inv_n};
        grad_row(f, dyr, w, xhat, dxr, dwp, dbp, n);
      }
    }
  });
}

// Thread-level kernels for norm_ops.h's tensor-level functions.
struct CpuKernels {
  // Chunks of rows for the backward pass: one per thread, each owning a partial dw/db row.
  static int64_t param_grad_chunks(int64_t rows, int64_t n) {
    const int64_t by_work = std::max<int64_t>(1, rows / rows_grain(n));
    return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), by_work));
  }

  template <typename in_t, typename out_t, bool kRms, typename acc_t>
  static void forward(const in_t* x, const acc_t* w, const acc_t* b, out_t* y, acc_t* mean, acc_t* rstd,
                      int64_t rows, int64_t n, double eps) {
    forward_rows<in_t, out_t, kRms>(x, w, b, y, mean, rstd, rows, n, eps);
  }

  template <typename in_t, typename out_t, typename saved_t, bool kRms, bool kFromOutput, typename acc_t>
  static void backward(const out_t* dy, const saved_t* saved, const acc_t* mean, const acc_t* rstd, const acc_t* w,
                       const acc_t* b, in_t* dx, acc_t* dw_partial, acc_t* db_partial, int64_t rows, int64_t n,
                       int64_t chunks) {
    backward_rows<in_t, out_t, saved_t, kRms, kFromOutput>(dy, saved, mean, rstd, w, b, dx, dw_partial, db_partial,
                                                             rows, n, chunks);
  }
};

}  // namespace

TORCH_LIBRARY(ampkit_norms, m) {
  define_schemas(m);
}

TORCH_LIBRARY_IMPL(ampkit_norms, CPU, m) {
  register_impls<CpuKernels>(m);
}

}  // namespace norms
}  // namespace ampkit
