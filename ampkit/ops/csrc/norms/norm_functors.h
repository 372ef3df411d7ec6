// Per-element and per-row math of LayerNorm and RMSNorm, written once for the CPU loops
// (norms_cpu.cpp) and the CUDA kernels (norms_cuda.cu): the CPU tests exercise these very functors.
//
// Notation per row of n elements: xhat = (x - mean) * rstd (RMSNorm: mean = 0),
// y = xhat * w + b, g = dy * w. Backward:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMSNorm drops the mean(g) term)
//   dw = sum over rows of dy * xhat,  db = sum over rows of dy.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

namespace ampkit {
namespace norms {

// 1 / sqrt(variance + eps); variance is the biased (divide-by-n) second moment.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t rstd_from_variance(acc_t variance, acc_t eps) {
  return acc_t(1) / ::sqrt(variance + eps);
}

// y = (x - mean) * rstd * w + b.
template <typename acc_t>
struct NormForward {
  acc_t mean;
  acc_t rstd;
  C10_HOST_DEVICE inline acc_t operator()(acc_t x, acc_t w, acc_t b) const {
    return (x - mean) * rstd * w + b;
  }
};

// xhat recomputed from the saved input (the default).
template <typename acc_t>
struct NormalizedFromInput {
  acc_t mean;
  acc_t rstd;
  C10_HOST_DEVICE inline acc_t operator()(acc_t x) const { return (x - mean) * rstd; }
};

// xhat recomputed from the saved output (memory_efficient=True): xhat = (y - b) / w.
// As in Apex, a zero weight element makes that column's xhat non-finite.
template <typename acc_t>
struct NormalizedFromOutput {
  C10_HOST_DEVICE inline acc_t operator()(acc_t y, acc_t w, acc_t b) const { return (y - b) / w; }
};

// dx = rstd * (g - mean_g - xhat * mean_gxhat), given the row sums of g and g * xhat.
template <typename acc_t>
struct NormInputGrad {
  acc_t rstd;
  acc_t mean_g;      // 0 for RMSNorm
  acc_t mean_gxhat;
  C10_HOST_DEVICE inline acc_t operator()(acc_t g, acc_t xhat) const {
    return rstd * (g - mean_g - xhat * mean_gxhat);
  }
};

}  // namespace norms
}  // namespace ampkit
