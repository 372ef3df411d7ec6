// CUDA kernels of the ampkit_multi_tensor ops. The per-element math is the functors.h code the CPU
// kernels run (and the CPU tests check); only chunk indexing, reductions and launches are CUDA-only.
#include <c10/util/Exception.h>

#include "common/accumulate.h"
#include "common/multi_tensor_cuda.cuh"
#include "multi_tensor/functors.h"
#include "multi_tensor/multi_tensor_cuda.h"

namespace ampkit {
namespace cuda {
namespace {

void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

template <typename F>
void dispatch(Dtype type, F&& f) {
  switch (type) {
    case Dtype::kFloat:
      f(float{});
      break;
    case Dtype::kHalf:
      f(c10::Half{});
      break;
    case Dtype::kBFloat16:
      f(c10::BFloat16{});
      break;
    case Dtype::kDouble:
      f(double{});
      break;
  }
}

template <typename F>
void dispatch_in_out(Dtype in, Dtype out, F&& f) {
  dispatch(in, [&](auto in_tag) { dispatch(out, [&](auto out_tag) { f(in_tag, out_tag); }); });
}

// Each body walks its chunk with for_each_lane_group: element by element (kVectorize false: the loops a GPU run
// verified), or with kVectorize in vectors of kVectorElements where the chunk's addresses allow it.
template <typename TI, typename TO, bool kVectorize>
struct ScaleBody {
  using A = pair_acc_t<TI, TO>;
  __device__ void operator()(const TensorListMeta<2>& meta, int block, A factor, FlagRef flag) const {
    const TI* x = chunk_ptr<const TI>(meta, block, 0);
    TO* y = chunk_ptr<TO>(meta, block, 1);
    const ScaleOp<A> op{factor};
    bool bad = false;
    for_each_lane_group(chunk_length(meta, block), kVectorize && chunk_vectorized(meta, block), [&](auto w, int64_t i) {
      constexpr int W = decltype(w)::value;
      Lanes<TI, W> in;
      Lanes<TO, W> out;
      in.load(x + i);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const A v = static_cast<A>(in.v[k]);
        bad |= is_nonfinite(v);
        out.v[k] = static_cast<TO>(op(v));
      }
      out.store(y + i);
    });
    if (bad) flag.raise();
  }
};

template <typename TI, typename TO, bool kVectorize>
struct AxpbyBody {
  using A = pair_acc_t<TI, TO>;
  __device__ void operator()(const TensorListMeta<3>& meta, int block, A a, A b, int arg_to_check,
                             FlagRef flag) const {
    const TI* x = chunk_ptr<const TI>(meta, block, 0);
    const TI* y = chunk_ptr<const TI>(meta, block, 1);
    TO* out = chunk_ptr<TO>(meta, block, 2);
    const AxpbyOp<A> op{a, b};
    bool bad = false;
    for_each_lane_group(chunk_length(meta, block), kVectorize && chunk_vectorized(meta, block), [&](auto w, int64_t i) {
      constexpr int W = decltype(w)::value;
      Lanes<TI, W> xs;
      Lanes<TI, W> ys;
      Lanes<TO, W> os;
      xs.load(x + i);
      ys.load(y + i);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const A xv = static_cast<A>(xs.v[k]);
        const A yv = static_cast<A>(ys.v[k]);
        if (arg_to_check != 1) bad |= is_nonfinite(xv);
        if (arg_to_check != 0) bad |= is_nonfinite(yv);
        os.v[k] = static_cast<TO>(op(xv, yv));
      }
      os.store(out + i);
    });
    if (bad) flag.raise();
  }
};

template <typename TI, typename TO, bool kVectorize>
struct CombineBody {
  using A = pair_acc_t<TI, TO>;
  __device__ void operator()(const TensorListMeta<3>& meta, int block, A inv_scale, FlagRef flag) const {
    const TI* fresh = chunk_ptr<const TI>(meta, block, 0);
    const TO* stash = chunk_ptr_or_null<const TO>(meta, block, 1);
    TO* out = chunk_ptr<TO>(meta, block, 2);
    const CombineOp<A> op{inv_scale};
    bool bad = false;
    for_each_lane_group(chunk_length(meta, block), kVectorize && chunk_vectorized(meta, block), [&](auto w, int64_t i) {
      constexpr int W = decltype(w)::value;
      Lanes<TI, W> fs;
      Lanes<TO, W> ss;
      Lanes<TO, W> os;
      fs.load(fresh + i);
      if (stash != nullptr) ss.load(stash + i);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const A v = static_cast<A>(fs.v[k]);
        bad |= is_nonfinite(v);
        os.v[k] = static_cast<TO>(op(v, stash != nullptr ? static_cast<A>(ss.v[k]) : A(0)));
      }
      os.store(out + i);
    });
    if (bad) flag.raise();
  }
};

template <typename TI, typename TO, bool kWrite, bool kVectorize>
struct SumSquaresBody {
  using A = acc_t<TI>;
  __device__ void operator()(const TensorListMeta<2>& meta, int block, A factor, bool check, FlagRef flag,
                             double* sumsq) const {
    const TI* x = chunk_ptr<const TI>(meta, block, 0);
    TO* y = kWrite ? chunk_ptr<TO>(meta, block, 1) : nullptr;
    const ScaleOp<A> unscale{factor};
    A acc = 0;
    bool bad = false;
    for_each_lane_group(chunk_length(meta, block), kVectorize && chunk_vectorized(meta, block), [&](auto w, int64_t i) {
      constexpr int W = decltype(w)::value;
      Lanes<TI, W> xs;
      Lanes<TO, W> ys;
      xs.load(x + i);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const A raw = static_cast<A>(xs.v[k]);
        if (check) bad |= is_nonfinite(raw);
        const A v = unscale(raw);
        if (kWrite) ys.v[k] = static_cast<TO>(v);
        acc += square(v);
      }
      if (kWrite) ys.store(y + i);
    });
    if (bad) flag.raise();
    const A total = block_sum(acc);
    if (threadIdx.x == 0) atomicAdd(&sumsq[meta.index[meta.block_to_tensor[block]]], static_cast<double>(total));
  }
};

// Runs f(std::bool_constant<vectorize>) with the runtime choice as a compile-time one.
template <typename F>
void with_vectorize(bool vectorize, F&& f) {
  if (vectorize) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlockThreads)
    finish_norms_kernel(const double* sumsq, int64_t count, T* total, T* per_tensor) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    acc += sumsq[i];
    if (per_tensor != nullptr) per_tensor[i] = static_cast<T>(::sqrt(sumsq[i]));
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) *total = static_cast<T>(::sqrt(acc));
}

}  // namespace

void launch_scale(const TensorSlots* tensors, int64_t count, Dtype in, Dtype out, double factor, FlagRef flag,
                  bool vectorize, cudaStream_t stream) {
  dispatch_in_out(in, out, [&](auto in_tag, auto out_tag) {
    with_vectorize(vectorize, [&](auto vec) {
      using TI = decltype(in_tag);
      using TO = decltype(out_tag);
      using Body = ScaleBody<TI, TO, decltype(vec)::value>;
      const int bytes[2] = {sizeof(TI), sizeof(TO)};
      launch_multi_tensor<2>(tensors, count, bytes, stream, Body{}, static_cast<typename Body::A>(factor), flag);
    });
  });
  check_launch("ampkit_multi_tensor.scale_");
}

void launch_axpby(const TensorSlots* tensors, int64_t count, Dtype in, Dtype out, double a, double b,
                  int arg_to_check, FlagRef flag, bool vectorize, cudaStream_t stream) {
  dispatch_in_out(in, out, [&](auto in_tag, auto out_tag) {
    with_vectorize(vectorize, [&](auto vec) {
      using TI = decltype(in_tag);
      using TO = decltype(out_tag);
      using Body = AxpbyBody<TI, TO, decltype(vec)::value>;
      using A = typename Body::A;
      const int bytes[3] = {sizeof(TI), sizeof(TI), sizeof(TO)};
      launch_multi_tensor<3>(tensors, count, bytes, stream, Body{}, static_cast<A>(a), static_cast<A>(b),
                             arg_to_check, flag);
    });
  });
  check_launch("ampkit_multi_tensor.axpby_");
}

void launch_combine(const TensorSlots* tensors, int64_t count, Dtype in, Dtype out, double inv_scale, FlagRef flag,
                    bool vectorize, cudaStream_t stream) {
  dispatch_in_out(in, out, [&](auto in_tag, auto out_tag) {
    with_vectorize(vectorize, [&](auto vec) {
      using TI = decltype(in_tag);
      using TO = decltype(out_tag);
      using Body = CombineBody<TI, TO, decltype(vec)::value>;
      const int bytes[3] = {sizeof(TI), sizeof(TO), sizeof(TO)};
      launch_multi_tensor<3>(tensors, count, bytes, stream, Body{}, static_cast<typename Body::A>(inv_scale), flag);
    });
  });
  check_launch("ampkit_multi_tensor.combine_");
}

void launch_sum_squares(const TensorSlots* tensors, int64_t count, Dtype in, Dtype out, double factor, bool check,
                        FlagRef flag, double* sumsq, bool write, bool vectorize, cudaStream_t stream) {
  dispatch_in_out(in, out, [&](auto in_tag, auto out_tag) {
    with_vectorize(vectorize, [&](auto vec) {
      using TI = decltype(in_tag);
      using TO = decltype(out_tag);
      constexpr bool V = decltype(vec)::value;
      const auto f = static_cast<acc_t<TI>>(factor);
      const int bytes[2] = {sizeof(TI), sizeof(TO)};
      if (write) {
        launch_multi_tensor<2>(tensors, count, bytes, stream, SumSquaresBody<TI, TO, true, V>{}, f, check, flag,
                               sumsq);
      } else {
        launch_multi_tensor<2>(tensors, count, bytes, stream, SumSquaresBody<TI, TO, false, V>{}, f, check, flag,
                               sumsq);
      }
    });
  });
  check_launch("ampkit_multi_tensor.l2norm");
}

void launch_finish_norms(const double* sumsq, int64_t count, Dtype out, void* total, void* per_tensor,
                         cudaStream_t stream) {
  if (out == Dtype::kDouble) {
    finish_norms_kernel<double><<<1, kBlockThreads, 0, stream>>>(sumsq, count, static_cast<double*>(total),
                                                                 static_cast<double*>(per_tensor));
  } else {
    finish_norms_kernel<float><<<1, kBlockThreads, 0, stream>>>(sumsq, count, static_cast<float*>(total),
                                                                static_cast<float*>(per_tensor));
  }
  check_launch("ampkit_multi_tensor.l2norm");
}

}  // namespace cuda
}  // namespace ampkit
