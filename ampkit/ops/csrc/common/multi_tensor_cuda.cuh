// CUDA multi-tensor driver (Apex's scheme): tensor addresses and a block -> (tensor, chunk) map travel
// in the kernel's parameter block (< 4 KB), so one launch covers up to kMaxBlocks chunks of up to
// kMaxTensors tensors, and small tensors never cost a launch each. The launch table is plan_chunks'
// (chunk_plan.h, plain C++ the CPU tests run); this header only copies it into the parameter block and
// gives kernels their chunk. Plain CUDA: no ATen headers.
#pragma once

#include <cuda_runtime.h>

#include <c10/macros/Macros.h>

#include <cstdint>
#include <type_traits>

#include "common/chunk_plan.h"
#include "common/multi_tensor_cuda_types.h"

namespace ampkit {
namespace cuda {

constexpr int kBlockThreads = 512;

// One launch's tensors and blocks, filled from a PlannedLaunch (chunk_plan.h) and passed by value.
template <int Depth>
struct TensorListMeta {
  static constexpr int kMaxTensors = max_tensors_for_depth(Depth);
  void* ptr[Depth][kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t index[kMaxTensors];
  bool vectorized[kMaxTensors];
  unsigned char block_to_tensor[kMaxBlocks];
  int block_to_chunk[kMaxBlocks];
};

// Kernel parameters are limited to 4 KB; leave room for the op's own arguments.
static_assert(sizeof(TensorListMeta<1>) <= 3900 && sizeof(TensorListMeta<2>) <= 3900, "metadata too large");
static_assert(sizeof(TensorListMeta<3>) <= 3900 && sizeof(TensorListMeta<4>) <= 3900, "metadata too large");
static_assert(sizeof(TensorListMeta<5>) <= 3600 && sizeof(TensorListMeta<6>) <= 3600, "metadata too large");

template <int Depth, typename Body, typename... Args>
__global__ void __launch_bounds__(kBlockThreads) multi_tensor_kernel(TensorListMeta<Depth> meta, Body body, Args... args) {
  body(meta, blockIdx.x, args...);
}

// Launches `Body` once per launch of plan_chunks(tensors, ...): `element_bytes[d]` is the size of slot d's type.
template <int Depth, typename Body, typename... Args>
void launch_multi_tensor(const TensorSlots* tensors, int64_t count, const int (&element_bytes)[Depth],
                         cudaStream_t stream, Body body, Args... args) {
  for (const PlannedLaunch& launch : plan_chunks(tensors, count, Depth, element_bytes)) {
    TensorListMeta<Depth> meta;
    for (size_t t = 0; t < launch.tensors.size(); ++t) {
      const TensorSlots& source = tensors[launch.tensors[t].source];
      for (int d = 0; d < Depth; ++d) meta.ptr[d][t] = source.ptr[d];
      meta.numel[t] = source.numel;
      meta.index[t] = source.index;
      meta.vectorized[t] = launch.tensors[t].vectorized;
    }
    for (size_t b = 0; b < launch.blocks.size(); ++b) {
      meta.block_to_tensor[b] = static_cast<unsigned char>(launch.blocks[b].tensor);
      meta.block_to_chunk[b] = static_cast<int>(launch.blocks[b].chunk);
    }
    const auto blocks = static_cast<unsigned int>(launch.blocks.size());
    multi_tensor_kernel<Depth><<<blocks, kBlockThreads, 0, stream>>>(meta, body, args...);
  }
}

// This block's chunk of slot `d`: base pointer and element count.
template <typename T, int Depth>
__device__ inline T* chunk_ptr(const TensorListMeta<Depth>& meta, int block, int d) {
  const int t = meta.block_to_tensor[block];
  return static_cast<T*>(meta.ptr[d][t]) + static_cast<int64_t>(meta.block_to_chunk[block]) * kChunkElements;
}
template <int Depth>
__device__ inline int64_t chunk_length(const TensorListMeta<Depth>& meta, int block) {
  const int t = meta.block_to_tensor[block];
  const int64_t rest = meta.numel[t] - static_cast<int64_t>(meta.block_to_chunk[block]) * kChunkElements;
  return rest < kChunkElements ? rest : kChunkElements;
}
template <int Depth>
__device__ inline bool chunk_vectorized(const TensorListMeta<Depth>& meta, int block) {
  return meta.vectorized[meta.block_to_tensor[block]];
}
// Slot `d`'s chunk, or nullptr where the tensor has no such slot (an optional list).
template <typename T, int Depth>
__device__ inline T* chunk_ptr_or_null(const TensorListMeta<Depth>& meta, int block, int d) {
  return meta.ptr[d][meta.block_to_tensor[block]] == nullptr ? nullptr : chunk_ptr<T>(meta, block, d);
}

// W consecutive elements of one slot in registers; with W == kVectorElements they move as one aligned vector
// (16 bytes for float32), which plan_chunks allowed only where every address of the tensor is aligned.
template <typename T, int W>
struct alignas(sizeof(T) * W) Lanes {
  T v[W];
  __device__ void load(const T* p) { *this = *reinterpret_cast<const Lanes*>(p); }
  __device__ void store(T* p) const { *reinterpret_cast<Lanes*>(p) = *this; }
};

// Calls f(std::integral_constant<int, W>, i) over [0, n) of one chunk, each thread taking W elements at i: vectors
// of kVectorElements where `vectorized`, then one element at a time for the tail (or the whole chunk otherwise).
template <typename F>
__device__ inline void for_each_lane_group(int64_t n, bool vectorized, F&& f) {
  int64_t begin = 0;
  if (vectorized) {
    const int64_t whole = n / kVectorElements * kVectorElements;
    for (int64_t i = threadIdx.x * int64_t(kVectorElements); i < whole; i += int64_t(blockDim.x) * kVectorElements)
      f(std::integral_constant<int, kVectorElements>{}, i);
    begin = whole;
  }
  for (int64_t i = begin + threadIdx.x; i < n; i += blockDim.x) f(std::integral_constant<int, 1>{}, i);
}

// Sum of `value` over the block; the result is valid in thread 0.
template <typename A>
__device__ inline A block_sum(A value) {
  __shared__ A partial[kBlockThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  value = threadIdx.x < kBlockThreads / 32 ? partial[threadIdx.x] : A(0);
  if (warp == 0) {
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  return value;
}

}  // namespace cuda
}  // namespace ampkit
