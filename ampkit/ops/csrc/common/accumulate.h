// Accumulation types and the non-finite test, usable from host C++ and CUDA device code alike.
// Only c10 macros/half types: this header is included by .cu files compiled with plain nvcc.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace ampkit {

// Half-precision inputs accumulate (and compute) in float; float64 stays float64.
template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};
template <typename T>
using acc_t = typename AccType<T>::type;

// True for +-inf and nan. `v - v` is 0 for every finite v and nan otherwise; written without
// isfinite() so gcc vectorizes it as a compare and nvcc needs no <cmath> overloads.
template <typename T>
C10_HOST_DEVICE inline bool is_nonfinite(T v) {
  return !(v - v == T(0));
}

}  // namespace ampkit

namespace ampkit {

// Compute type for an op reading TIn and writing TOut: float, or double when either side is double.
template <typename TIn, typename TOut>
struct PairAccType {
  using type = acc_t<TIn>;
};
template <typename TIn>
struct PairAccType<TIn, double> {
  using type = double;
};
template <typename TIn, typename TOut>
using pair_acc_t = typename PairAccType<TIn, TOut>::type;

}  // namespace ampkit
