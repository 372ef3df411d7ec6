// Reductions the optimizers need (CPU): the global L2 norm of scaled gradients together with the
// non-finite check in one read (pass 1 of the fused amp step, LAMB's global clipping), and per-tensor
// L2 norms (LAMB trust ratios, NovoGrad). Partial sums are kept per fixed-size chunk, so the result does
// not depend on the number of threads.
#include <ATen/ops/empty.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_multi_tensor.h"

namespace ampkit {
namespace optim {
namespace {

constexpr int64_t kChunk = int64_t(1) << 16;

struct Chunk {
  size_t tensor;
  int64_t begin;
  int64_t end;
};

std::vector<Chunk> make_chunks(at::TensorList tensors) {
  std::vector<Chunk> chunks;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t n = tensors[t].numel();
    for (int64_t b = 0; b < n; b += kChunk) chunks.push_back({t, b, std::min(n, b + kChunk)});
  }
  return chunks;
}

struct SumSq {
  double sumsq = 0.0;
  bool nonfinite = false;
};

// Sum of (x * factor)^2 over x[0, n), and whether any raw x is inf/nan. Float lanes, flushed to double
// every block: vectorizes without -ffast-math and keeps the float rounding error bounded.
template <typename T, typename acc_t>
SumSq sum_squares(const T* __restrict__ x, int64_t n, acc_t factor) {
  constexpr int kLanes = 16;
  constexpr int64_t kBlock = 2048;
  SumSq out;
  acc_t probe[kLanes] = {};  // raw * 0 is nan exactly when raw is inf or nan
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t bn = std::min(kBlock, n - b0);
    const T* __restrict__ xb = x + b0;
    acc_t lanes[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= bn; i += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        const acc_t raw = static_cast<acc_t>(xb[i + j]);
        const acc_t u = raw * factor;
        lanes[j] += u * u;
        probe[j] += raw * acc_t(0);
      }
    }
    for (; i < bn; ++i) {
      const acc_t raw = static_cast<acc_t>(xb[i]);
      const acc_t u = raw * factor;
      lanes[0] += u * u;
      probe[0] += raw * acc_t(0);
    }
    for (int j = 0; j < kLanes; ++j) out.sumsq += static_cast<double>(lanes[j]);
  }
  for (int j = 0; j < kLanes; ++j) out.nonfinite = out.nonfinite || !(probe[j] == probe[j]);
  return out;
}

std::vector<SumSq> chunk_sums(const char* op, at::TensorList tensors, double factor) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.device().is_cpu(), op, ": tensors[", i, "] is on ", t.device(), "; expected cpu");
    TORCH_CHECK(is_supported_float(t.scalar_type()), op, ": tensors[", i, "] has dtype ", t.scalar_type(),
                "; expected float32, float64, float16 or bfloat16");
    TORCH_CHECK(t.is_non_overlapping_and_dense(), op, ": tensors[", i,
                "] is not dense (a strided view); pass contiguous or dense tensors");
  }
  const std::vector<Chunk> chunks = make_chunks(tensors);
  std::vector<SumSq> sums(chunks.size());
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const Chunk& ch = chunks[c];
      const at::Tensor& t = tensors[ch.tensor];
      switch (t.scalar_type()) {
        case at::kDouble:
          sums[c] = sum_squares<double, double>(ptr<double>(t) + ch.begin, ch.end - ch.begin, factor);
          break;
        case at::kFloat:
          sums[c] = sum_squares<float, float>(ptr<float>(t) + ch.begin, ch.end - ch.begin, float(factor));
          break;
        case at::kHalf:
          sums[c] = sum_squares<c10::Half, float>(ptr<c10::Half>(t) + ch.begin, ch.end - ch.begin, float(factor));
          break;
        default:
          sums[c] = sum_squares<c10::BFloat16, float>(ptr<c10::BFloat16>(t) + ch.begin, ch.end - ch.begin,
                                                     float(factor));
      }
    }
  });
  // Tag each chunk's tensor for per-tensor reductions.
  std::vector<SumSq> tagged(tensors.size());
  for (size_t c = 0; c < chunks.size(); ++c) {
    tagged[chunks[c].tensor].sumsq += sums[c].sumsq;
    tagged[chunks[c].tensor].nonfinite = tagged[chunks[c].tensor].nonfinite || sums[c].nonfinite;
  }
  return tagged;
}

// Returns float64 [norm, found_inf]: the L2 norm of all grads times grad_factor, and 1.0 if any raw
// gradient element is inf or nan.
at::Tensor grad_norm_and_check_cpu(at::TensorList grads, double grad_factor) {
  const std::vector<SumSq> sums = chunk_sums("grad_norm_and_check", grads, grad_factor);
  double total = 0.0;
  bool nonfinite = false;
  for (const SumSq& s : sums) {
    total += s.sumsq;
    nonfinite = nonfinite || s.nonfinite;
  }
  at::Tensor out = at::empty({2}, at::TensorOptions().dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  o[0] = nonfinite ? std::nan("") : std::sqrt(total);
  o[1] = nonfinite ? 1.0 : 0.0;
  return out;
}

// Returns float64 [n]: the L2 norm of each tensor times factor.
at::Tensor per_tensor_norms_cpu(at::TensorList tensors, double factor) {
  const std::vector<SumSq> sums = chunk_sums("per_tensor_norms", tensors, factor);
  at::Tensor out = at::empty({static_cast<int64_t>(tensors.size())}, at::TensorOptions().dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  for (size_t i = 0; i < sums.size(); ++i) o[i] = sums[i].nonfinite ? std::nan("") : std::sqrt(sums[i].sumsq);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ampkit_optimizers, CompositeExplicitAutograd, m) {
  m.impl("grad_norm_and_check", &grad_norm_and_check_cpu);
  m.impl("per_tensor_norms", &per_tensor_norms_cpu);
}

}  // namespace optim
}  // namespace ampkit
