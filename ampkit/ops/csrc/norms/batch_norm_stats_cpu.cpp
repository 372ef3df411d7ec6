// SyncBatchNorm's local (per-rank) statistics on CPU: per-channel mean and 1/sqrt(var + eps), as
// torch.batch_norm_stats computes on CUDA (torch has no CPU kernel for it; its CPU stand-in,
// batch_norm_update_stats, runs scalar double-precision loops in two passes and measured 6-25x slower
// on NCHW inputs). The backward reductions are left to torch: native_batch_norm_backward already
// computes them in one vectorised pass (a fused version here measured no faster).
//
// One pass over memory. Two layouts:
//  * planes (NCHW-contiguous): channels split across threads; each (n, c)
//    plane is summed twice from cache (mean, then centred squares) and merged into the channel's
//    running (count, mean, M2) with Chan's update, which stays accurate for large counts and means.
//  * rows (channels-last, or [N, C] inputs): each thread owns a block of
//    rows and keeps per-channel (mean, M2) of blocks of kBlockRows rows, vectorised across channels;
//    the per-thread results are merged at the end.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace ampkit {
namespace norms {
namespace {

using at::Tensor;

constexpr int64_t kBlockRows = 64;

// Running per-channel moments: count, mean and sum of squared deviations (M2).
template <typename acc_t>
struct Moments {
  acc_t count = 0;
  acc_t mean = 0;
  acc_t m2 = 0;

  // Chan et al.: merge a batch of `n` values with mean `m` and squared deviations `q`.
  void merge(acc_t n, acc_t m, acc_t q) {
    if (n == 0) return;
    const acc_t total = count + n;
    const acc_t delta = m - mean;
    mean += delta * (n / total);
    m2 += q + delta * delta * (count * n / total);
    count = total;
  }
};

inline float load(float v) { return v; }
inline double load(double v) { return v; }
inline float load(at::Half v) { return static_cast<float>(v); }
inline float load(at::BFloat16 v) { return static_cast<float>(v); }

// Layout of `input` as [outer, C, inner] (planes path) or [rows, C] (rows path).
struct Layout {
  int64_t outer, channels, inner;
  bool rows;  // true: [rows = outer * inner, C] with C contiguous
};

Layout layout_of(const Tensor& input) {
  TORCH_CHECK(input.dim() >= 2, "ampkit_norms::batch_norm_stats: input must have a channel dim 1, got shape ",
              input.sizes());
  const int64_t n = input.size(0), c = input.size(1);
  const int64_t inner = c == 0 || n == 0 ? 0 : input.numel() / (n * c);
  const bool channels_last =
      (input.dim() == 4 && input.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
      (input.dim() == 5 && input.is_contiguous(at::MemoryFormat::ChannelsLast3d));
  if (channels_last && !input.is_contiguous()) return {n, c, inner, true};
  TORCH_CHECK(input.is_contiguous(), "ampkit_norms: input must be contiguous or channels-last, got strides ",
              input.strides());
  return {n, c, inner, inner == 1};  // [N, C] is already rows of channels
}

template <typename scalar_t>
void stats_planes(const scalar_t* x, at::opmath_type<scalar_t>* mean, at::opmath_type<scalar_t>* invstd,
                  const Layout& l, double eps) {
  using acc_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, l.channels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      Moments<acc_t> mom;
      for (int64_t o = 0; o < l.outer; ++o) {
        const scalar_t* p = x + (o * l.channels + c) * l.inner;
        acc_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < l.inner; ++i) sum += load(p[i]);
        const acc_t m = sum / acc_t(l.inner);
        acc_t q = 0;
#pragma omp simd reduction(+ : q)
        for (int64_t i = 0; i < l.inner; ++i) {
          const acc_t d = load(p[i]) - m;
          q += d * d;
        }
        mom.merge(acc_t(l.inner), m, q);
      }
      mean[c] = mom.mean;
      invstd[c] = acc_t(1) / std::sqrt(mom.m2 / mom.count + acc_t(eps));
    }
  });
}

template <typename scalar_t>
void stats_rows(const scalar_t* x, at::opmath_type<scalar_t>* mean, at::opmath_type<scalar_t>* invstd,
                const Layout& l, double eps) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = l.outer * l.inner, C = l.channels;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows / kBlockRows));
  // Per chunk: count (same for all channels), mean[C], m2[C].
  std::vector<acc_t> counts(chunks, 0), means(chunks * C, 0), m2s(chunks * C, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    std::vector<acc_t> block_sum(C), block_q(C);
    for (int64_t k = cb; k < ce; ++k) {
      acc_t* cm = means.data() + k * C;
      acc_t* cq = m2s.data() + k * C;
      acc_t count = 0;
      for (int64_t r0 = rows * k / chunks, r_end = rows * (k + 1) / chunks; r0 < r_end; r0 += kBlockRows) {
        const int64_t r1 = std::min(r0 + kBlockRows, r_end);
        const acc_t nb = acc_t(r1 - r0);
        std::fill(block_sum.begin(), block_sum.end(), acc_t(0));
        std::fill(block_q.begin(), block_q.end(), acc_t(0));
        acc_t* __restrict bs = block_sum.data();
        acc_t* __restrict bq = block_q.data();
        for (int64_t r = r0; r < r1; ++r) {
          const scalar_t* __restrict xr = x + r * C;
          for (int64_t c = 0; c < C; ++c) bs[c] += load(xr[c]);
        }
        for (int64_t c = 0; c < C; ++c) bs[c] /= nb;  // block means
        for (int64_t r = r0; r < r1; ++r) {
          const scalar_t* __restrict xr = x + r * C;
          for (int64_t c = 0; c < C; ++c) {
            const acc_t d = load(xr[c]) - bs[c];
            bq[c] += d * d;
          }
        }
        const acc_t total = count + nb;
        const acc_t w_new = nb / total, w_cross = count * nb / total;
        for (int64_t c = 0; c < C; ++c) {
          const acc_t delta = bs[c] - cm[c];
          cm[c] += delta * w_new;
          cq[c] += bq[c] + delta * delta * w_cross;
        }
        count = total;
      }
      counts[k] = count;
    }
  });
  for (int64_t c = 0; c < C; ++c) {
    Moments<acc_t> mom;
    for (int64_t k = 0; k < chunks; ++k) mom.merge(counts[k], means[k * C + c], m2s[k * C + c]);
    mean[c] = mom.mean;
    invstd[c] = acc_t(1) / std::sqrt(mom.m2 / mom.count + acc_t(eps));
  }
}

at::ScalarType acc_of(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

void check_float(const Tensor& t, const char* name) {
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16,
              "ampkit_norms: ", name, " must be float16, bfloat16, float32 or float64, got ", s);
}

template <typename Fn>
void dispatch_float(at::ScalarType t, Fn&& fn) {
  switch (t) {
    case at::kFloat:
      return fn(float{});
    case at::kDouble:
      return fn(double{});
    case at::kHalf:
      return fn(at::Half{});
    case at::kBFloat16:
      return fn(at::BFloat16{});
    default:
      TORCH_CHECK(false, "ampkit_norms: unsupported dtype ", t);
  }
}

std::tuple<Tensor, Tensor> batch_norm_stats(const Tensor& input, double eps) {
  check_float(input, "input");
  const Layout l = layout_of(input);
  TORCH_CHECK(l.outer * l.inner > 0, "ampkit_norms::batch_norm_stats: input ", input.sizes(),
              " has no elements per channel");
  const auto acc = acc_of(input.scalar_type());
  Tensor mean = at::empty({l.channels}, input.options().dtype(acc));
  Tensor invstd = at::empty({l.channels}, input.options().dtype(acc));
  dispatch_float(input.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    if (l.rows) {
      stats_rows(x, mean.mutable_data_ptr<acc_t>(), invstd.mutable_data_ptr<acc_t>(), l, eps);
    } else {
      stats_planes(x, mean.mutable_data_ptr<acc_t>(), invstd.mutable_data_ptr<acc_t>(), l, eps);
    }
  });
  return {mean, invstd};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ampkit_norms, m) {
  m.def("batch_norm_stats(Tensor input, float eps) -> (Tensor mean, Tensor invstd)");
}

TORCH_LIBRARY_IMPL(ampkit_norms, CPU, m) {
  m.impl("batch_norm_stats", &batch_norm_stats);
}

}  // namespace norms
}  // namespace ampkit
