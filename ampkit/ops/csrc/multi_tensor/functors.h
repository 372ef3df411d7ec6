// Per-element math of the multi-tensor ops, written once for the CPU loops and the CUDA kernels.
// A = accumulation type (float for half inputs). No ATen: included by .cu files.
#pragma once

#include <c10/macros/Macros.h>

namespace ampkit {

// out = x * factor (scale, unscale with factor = 1/scale).
template <typename A>
struct ScaleOp {
  A factor;
  C10_HOST_DEVICE A operator()(A x) const { return x * factor; }
};

// out = a * x + b * y.
template <typename A>
struct AxpbyOp {
  A a;
  A b;
  C10_HOST_DEVICE A operator()(A x, A y) const { return a * x + b * y; }
};

// grad = fresh * inv_scale + stashed: combines a backward's scaled grads with the stashed unscaled ones.
template <typename A>
struct CombineOp {
  A inv_scale;
  C10_HOST_DEVICE A operator()(A fresh, A stashed) const { return fresh * inv_scale + stashed; }
};

// One term of a sum of squares.
template <typename A>
C10_HOST_DEVICE inline A square(A v) {
  return v * v;
}

}  // namespace ampkit
