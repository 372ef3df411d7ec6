// Multi-tensor CUDA kernels of the optimizers torch has no fused op for (RMSprop, RMSprop-TF, Adadelta, LAMB's two
// stages, NovoGrad): one launch per planned block of tensors (common/chunk_plan.h), each block one chunk, moving
// kVectorElements per load and store where the tensor's addresses are aligned, element by element otherwise and
// for the tail. The math is optimizer_math.h's, rounded in the accumulate type as the per-tensor kernels and the
// CPU kernels round it; GradScaler's grad_scale and found_inf are read on the device (kernel_common.cuh).
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "common/multi_tensor_cuda.cuh"
#include "optimizers/kernel_common.cuh"
#include "optimizers/optimizers_multi_tensor.h"

namespace ampkit {
namespace optim {
namespace cuda {
namespace {

using ::ampkit::cuda::chunk_length;
using ::ampkit::cuda::chunk_ptr;
using ::ampkit::cuda::chunk_ptr_or_null;
using ::ampkit::cuda::chunk_vectorized;
using ::ampkit::cuda::for_each_lane_group;
using ::ampkit::cuda::Lanes;
using ::ampkit::cuda::launch_multi_tensor;
using ::ampkit::cuda::TensorListMeta;

template <typename T, int W>
__device__ inline Lanes<T, W> load_lanes(const T* p, int64_t i) {
  Lanes<T, W> out;
  out.load(p + i);
  return out;
}

// An optional state list: zeros where the tensor has none (the math then ignores them).
template <typename T, int W>
__device__ inline Lanes<T, W> load_or_zero(const T* p, int64_t i) {
  Lanes<T, W> out;
  if (p != nullptr) {
    out.load(p + i);
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) out.v[k] = T(0);
  }
  return out;
}

// The values the update starts from: the fp32 master copy where there is one, else the parameter widened.
template <typename P, typename A, int W>
__device__ inline Lanes<A, W> load_values(const P* param, const A* master, int64_t i) {
  if (master != nullptr) return load_lanes<A, W>(master, i);
  const Lanes<P, W> p = load_lanes<P, W>(param, i);
  Lanes<A, W> out;
#pragma unroll
  for (int k = 0; k < W; ++k) out.v[k] = static_cast<A>(p.v[k]);
  return out;
}

template <typename P, typename A, int W>
__device__ inline void store_values(P* param, A* master, int64_t i, const Lanes<A, W>& values) {
  if (master != nullptr) values.store(master + i);
  Lanes<P, W> p;
#pragma unroll
  for (int k = 0; k < W; ++k) p.v[k] = static_cast<P>(values.v[k]);
  p.store(param + i);
}

template <typename A, int W, typename G>
__device__ inline Lanes<A, W> widen(const Lanes<G, W>& g) {
  Lanes<A, W> out;
#pragma unroll
  for (int k = 0; k < W; ++k) out.v[k] = static_cast<A>(g.v[k]);
  return out;
}

// GradScaler's in-place unscale of the gradients read (scale 0: no scaler, leave them).
template <typename G, typename A, int W>
__device__ inline void write_unscaled_lanes(G* grad, int64_t i, const Lanes<A, W>& g, A scale) {
  if (scale == A(0)) return;
  Lanes<G, W> out;
#pragma unroll
  for (int k = 0; k < W; ++k) out.v[k] = static_cast<G>(g.v[k] / scale);
  out.store(grad + i);
}

// The two RMSprops' element updates, as types the shared body below takes.
template <typename A, bool CENTERED, bool MOMENTUM>
struct RMSpropElement {
  static constexpr bool kCentered = CENTERED;
  static constexpr bool kMomentum = MOMENTUM;
  __device__ void operator()(A& p, A g, A& sq, A& ga, A& b, const RMSpropHyper<A>& h) const {
    rmsprop_element<A, CENTERED, MOMENTUM>(p, g, sq, ga, b, h);
  }
};

template <typename A, bool CENTERED, bool MOMENTUM, bool LR_IN_MOMENTUM>
struct RMSpropTFElement {
  static constexpr bool kCentered = CENTERED;
  static constexpr bool kMomentum = MOMENTUM;
  __device__ void operator()(A& p, A g, A& sq, A& ga, A& b, const RMSpropTFHyper<A>& h) const {
    rmsprop_tf_element<A, CENTERED, MOMENTUM, LR_IN_MOMENTUM>(p, g, sq, ga, b, h);
  }
};

// RMSprop and RMSprop-TF share their lists (param, grad, square_avg, grad_avg?, momentum buffer?, master?) and
// their loop; `Element` is the one's update and says which optional lists it writes.
template <typename P, typename G, typename A, typename Hyper, class Element>
struct RMSpropFamilyBody {
  __device__ void operator()(const TensorListMeta<6>& meta, int block, Hyper h, double grad_factor,
                             ScalerPtrs scaler) const {
    if (skipped(scaler)) return;
    h.grad_factor = static_cast<A>(unscaled_factor(grad_factor, scaler));
    const A scale = write_back_scale<A>(scaler);
    P* param = chunk_ptr<P>(meta, block, 0);
    G* grad = chunk_ptr<G>(meta, block, 1);
    A* square_avg = chunk_ptr<A>(meta, block, 2);
    A* grad_avg = chunk_ptr_or_null<A>(meta, block, 3);
    A* buf = chunk_ptr_or_null<A>(meta, block, 4);
    A* master = chunk_ptr_or_null<A>(meta, block, 5);
    for_each_lane_group(chunk_length(meta, block), chunk_vectorized(meta, block), [&](auto w, int64_t i) {
      constexpr int W = decltype(w)::value;
      Lanes<A, W> value = load_values<P, A, W>(param, master, i);
      const Lanes<A, W> g = widen<A>(load_lanes<G, W>(grad, i));
      Lanes<A, W> sq = load_lanes<A, W>(square_avg, i);
      Lanes<A, W> ga = load_or_zero<A, W>(grad_avg, i);
      Lanes<A, W> b = load_or_zero<A, W>(buf, i);
#pragma unroll
      for (int k = 0; k < W; ++k) Element{}(value.v[k], g.v[k], sq.v[k], ga.v[k], b.v[k], h);
      sq.store(square_avg + i);
      if (Element::kCentered) ga.store(grad_avg + i);
      if (Element::kMomentum) b.store(buf + i);
      store_values(param, master, i, value);
      write_unscaled_lanes(grad, i, g, scale);
    });
  }
};

template <typename P, typename G, typename A>
struct AdadeltaBody {
  __device__ void operator()(const TensorListMeta<5>& meta, int block, AdadeltaHyper<A> h, double grad_factor,
                             ScalerPtrs scaler) const {
    if (skipped(scaler)) return;
    h.grad_factor = static_cast<A>(unscaled_factor(grad_factor, scaler));
    const A scale = write_back_scale<A>(scaler);
    P* param = chunk_ptr<P>(meta, block, 0);
    G* grad = chunk_ptr<G>(meta, block, 1);
    A* square_avg = chunk_ptr<A>(meta, block, 2);
    A* acc_delta = chunk_ptr<A>(meta, block, 3);
    A* master = chunk_ptr_or_null<A>(meta, block, 4);
    for_each_lane_group(chunk_length(meta, block), chunk_vectorized(meta, block), [&](auto w, int64_t i) {
      constexpr int W = decltype(w)::value;
      Lanes<A, W> value = load_values<P, A, W>(param, master, i);
      const Lanes<A, W> g = widen<A>(load_lanes<G, W>(grad, i));
      Lanes<A, W> sq = load_lanes<A, W>(square_avg, i);
      Lanes<A, W> ad = load_lanes<A, W>(acc_delta, i);
#pragma unroll
      for (int k = 0; k < W; ++k) adadelta_element<A>(value.v[k], g.v[k], sq.v[k], ad.v[k], h);
      sq.store(square_avg + i);
      ad.store(acc_delta + i);
      store_values(param, master, i, value);
      write_unscaled_lanes(grad, i, g, scale);
    });
  }
};

template <typename P, typename G, typename A, bool ADAMW>
struct LambStage1Body {
  __device__ void operator()(const TensorListMeta<6>& meta, int block, LambHyper<A> h) const {
    const P* param = chunk_ptr<const P>(meta, block, 0);
    const G* grad = chunk_ptr<const G>(meta, block, 1);
    A* exp_avg = chunk_ptr<A>(meta, block, 2);
    A* exp_avg_sq = chunk_ptr<A>(meta, block, 3);
    A* update = chunk_ptr<A>(meta, block, 4);
    const A* master = chunk_ptr_or_null<const A>(meta, block, 5);
    for_each_lane_group(chunk_length(meta, block), chunk_vectorized(meta, block), [&](auto w, int64_t i) {
      constexpr int W = decltype(w)::value;
      const Lanes<A, W> value = load_values<P, A, W>(param, master, i);
      const Lanes<A, W> g = widen<A>(load_lanes<G, W>(grad, i));
      Lanes<A, W> m = load_lanes<A, W>(exp_avg, i);
      Lanes<A, W> v = load_lanes<A, W>(exp_avg_sq, i);
      Lanes<A, W> u;
#pragma unroll
      for (int k = 0; k < W; ++k) lamb_stage1_element<A, ADAMW>(value.v[k], g.v[k], m.v[k], v.v[k], u.v[k], h);
      m.store(exp_avg + i);
      v.store(exp_avg_sq + i);
      u.store(update + i);
    });
  }
};

template <typename P, typename A>
struct LambStage2Body {
  __device__ void operator()(const TensorListMeta<3>& meta, int block, const double* ratios) const {
    const A ratio = static_cast<A>(ratios[meta.index[meta.block_to_tensor[block]]]);
    P* param = chunk_ptr<P>(meta, block, 0);
    const A* update = chunk_ptr<const A>(meta, block, 1);
    A* master = chunk_ptr_or_null<A>(meta, block, 2);
    for_each_lane_group(chunk_length(meta, block), chunk_vectorized(meta, block), [&](auto w, int64_t i) {
      constexpr int W = decltype(w)::value;
      Lanes<A, W> value = load_values<P, A, W>(param, master, i);
      const Lanes<A, W> u = load_lanes<A, W>(update, i);
#pragma unroll
      for (int k = 0; k < W; ++k) value.v[k] = value.v[k] - ratio * u.v[k];
      store_values(param, master, i, value);
    });
  }
};

template <typename P, typename G, typename A, bool REG_OUTSIDE_MOMENT>
struct NovoGradBody {
  __device__ void operator()(const TensorListMeta<4>& meta, int block, NovoGradHyper<A> h,
                             const double* denoms) const {
    h.denom = static_cast<A>(denoms[meta.index[meta.block_to_tensor[block]]]);
    P* param = chunk_ptr<P>(meta, block, 0);
    const G* grad = chunk_ptr<const G>(meta, block, 1);
    A* exp_avg = chunk_ptr<A>(meta, block, 2);
    A* master = chunk_ptr_or_null<A>(meta, block, 3);
    for_each_lane_group(chunk_length(meta, block), chunk_vectorized(meta, block), [&](auto w, int64_t i) {
      constexpr int W = decltype(w)::value;
      Lanes<A, W> value = load_values<P, A, W>(param, master, i);
      const Lanes<A, W> g = widen<A>(load_lanes<G, W>(grad, i));
      Lanes<A, W> m = load_lanes<A, W>(exp_avg, i);
#pragma unroll
      for (int k = 0; k < W; ++k) novograd_element<A, REG_OUTSIDE_MOMENT>(value.v[k], g.v[k], m.v[k], h);
      m.store(exp_avg + i);
      store_values(param, master, i, value);
    });
  }
};

}  // namespace

template <typename P, typename G, typename A>
void launch_rmsprop_multi(const TensorSlots* tensors, int64_t count, const RMSpropHyper<A>& h, double grad_factor,
                          ScalerPtrs scaler, bool centered, bool momentum, cudaStream_t stream) {
  const int bytes[6] = {sizeof(P), sizeof(G), sizeof(A), sizeof(A), sizeof(A), sizeof(A)};
  AMPKIT_BOOL_SWITCH(centered, CEN, AMPKIT_BOOL_SWITCH(momentum, MOM, {
    using Body = RMSpropFamilyBody<P, G, A, RMSpropHyper<A>, RMSpropElement<A, CEN, MOM>>;
    launch_multi_tensor<6>(tensors, count, bytes, stream, Body{}, h, grad_factor, scaler);
  }));
  check_launch("rmsprop_step (multi_tensor)");
}

template <typename P, typename G, typename A>
void launch_rmsprop_tf_multi(const TensorSlots* tensors, int64_t count, const RMSpropTFHyper<A>& h,
                             double grad_factor, ScalerPtrs scaler, bool centered, bool momentum, bool lr_in_momentum,
                             cudaStream_t stream) {
  const int bytes[6] = {sizeof(P), sizeof(G), sizeof(A), sizeof(A), sizeof(A), sizeof(A)};
  AMPKIT_BOOL_SWITCH(centered, CEN, AMPKIT_BOOL_SWITCH(momentum, MOM, AMPKIT_BOOL_SWITCH(lr_in_momentum, LIM, {
    using Body = RMSpropFamilyBody<P, G, A, RMSpropTFHyper<A>, RMSpropTFElement<A, CEN, MOM, LIM>>;
    launch_multi_tensor<6>(tensors, count, bytes, stream, Body{}, h, grad_factor, scaler);
  })));
  check_launch("rmsprop_tf_step (multi_tensor)");
}

template <typename P, typename G, typename A>
void launch_adadelta_multi(const TensorSlots* tensors, int64_t count, const AdadeltaHyper<A>& h, double grad_factor,
                           ScalerPtrs scaler, cudaStream_t stream) {
  const int bytes[5] = {sizeof(P), sizeof(G), sizeof(A), sizeof(A), sizeof(A)};
  launch_multi_tensor<5>(tensors, count, bytes, stream, AdadeltaBody<P, G, A>{}, h, grad_factor, scaler);
  check_launch("adadelta_step (multi_tensor)");
}

template <typename P, typename G, typename A>
void launch_lamb_stage1_multi(const TensorSlots* tensors, int64_t count, const LambHyper<A>& h, bool adam_w_mode,
                              cudaStream_t stream) {
  const int bytes[6] = {sizeof(P), sizeof(G), sizeof(A), sizeof(A), sizeof(A), sizeof(A)};
  AMPKIT_BOOL_SWITCH(adam_w_mode, ADAMW, {
    launch_multi_tensor<6>(tensors, count, bytes, stream, LambStage1Body<P, G, A, ADAMW>{}, h);
  });
  check_launch("lamb_stage1 (multi_tensor)");
}

template <typename P, typename A>
void launch_lamb_stage2_multi(const TensorSlots* tensors, int64_t count, const double* ratios, cudaStream_t stream) {
  const int bytes[3] = {sizeof(P), sizeof(A), sizeof(A)};
  launch_multi_tensor<3>(tensors, count, bytes, stream, LambStage2Body<P, A>{}, ratios);
  check_launch("lamb_stage2 (multi_tensor)");
}

template <typename P, typename G, typename A>
void launch_novograd_multi(const TensorSlots* tensors, int64_t count, const NovoGradHyper<A>& h,
                           const double* denoms, bool reg_inside_moment, cudaStream_t stream) {
  const int bytes[4] = {sizeof(P), sizeof(G), sizeof(A), sizeof(A)};
  AMPKIT_BOOL_SWITCH(!reg_inside_moment, OUTSIDE, {
    launch_multi_tensor<4>(tensors, count, bytes, stream, NovoGradBody<P, G, A, OUTSIDE>{}, h, denoms);
  });
  check_launch("novograd_step (multi_tensor)");
}

// The (param, grad) pairs of the per-tensor kernels (optimizers_kernels.cu).
#define AMPKIT_INSTANTIATE_MULTI(P, G, A)                                                                        \
  template void launch_rmsprop_multi<P, G, A>(const TensorSlots*, int64_t, const RMSpropHyper<A>&, double,        \
                                              ScalerPtrs, bool, bool, cudaStream_t);                             \
  template void launch_rmsprop_tf_multi<P, G, A>(const TensorSlots*, int64_t, const RMSpropTFHyper<A>&, double,   \
                                                 ScalerPtrs, bool, bool, bool, cudaStream_t);                    \
  template void launch_adadelta_multi<P, G, A>(const TensorSlots*, int64_t, const AdadeltaHyper<A>&, double,      \
                                               ScalerPtrs, cudaStream_t);                                        \
  template void launch_lamb_stage1_multi<P, G, A>(const TensorSlots*, int64_t, const LambHyper<A>&, bool,         \
                                                  cudaStream_t);                                                 \
  template void launch_novograd_multi<P, G, A>(const TensorSlots*, int64_t, const NovoGradHyper<A>&, const double*, \
                                               bool, cudaStream_t);

AMPKIT_INSTANTIATE_MULTI(double, double, double)
AMPKIT_INSTANTIATE_MULTI(float, float, float)
AMPKIT_INSTANTIATE_MULTI(c10::Half, c10::Half, float)
AMPKIT_INSTANTIATE_MULTI(c10::Half, float, float)
AMPKIT_INSTANTIATE_MULTI(c10::BFloat16, c10::BFloat16, float)
AMPKIT_INSTANTIATE_MULTI(c10::BFloat16, float, float)

template void launch_lamb_stage2_multi<double, double>(const TensorSlots*, int64_t, const double*, cudaStream_t);
template void launch_lamb_stage2_multi<float, float>(const TensorSlots*, int64_t, const double*, cudaStream_t);
template void launch_lamb_stage2_multi<c10::Half, float>(const TensorSlots*, int64_t, const double*, cudaStream_t);
template void launch_lamb_stage2_multi<c10::BFloat16, float>(const TensorSlots*, int64_t, const double*,
                                                             cudaStream_t);

}  // namespace cuda
}  // namespace optim
}  // namespace ampkit
