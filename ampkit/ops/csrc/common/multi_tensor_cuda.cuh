// CUDA multi-tensor driver (Apex's scheme): tensor addresses and a block -> (tensor, chunk) map travel
// in the kernel's parameter block (< 4 KB), so one launch covers up to kMaxBlocks chunks of up to
// kMaxTensors tensors, and small tensors never cost a launch each. Plain CUDA: no ATen headers.
#pragma once

#include <cuda_runtime.h>

#include <c10/macros/Macros.h>

#include <cstdint>

#include "common/multi_tensor_cuda_types.h"

namespace ampkit {
namespace cuda {

constexpr int kBlockThreads = 512;
constexpr int64_t kChunkElements = 65536;

template <int Depth>
struct TensorListMeta {
  static constexpr int kMaxTensors = Depth == 1 ? 90 : Depth == 2 ? 64 : Depth == 3 ? 48 : 36;
  static constexpr int kMaxBlocks = 320;
  void* ptr[Depth][kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t index[kMaxTensors];
  unsigned char block_to_tensor[kMaxBlocks];
  int block_to_chunk[kMaxBlocks];
};

// Kernel parameters are limited to 4 KB; leave room for the op's own arguments.
static_assert(sizeof(TensorListMeta<1>) <= 3900 && sizeof(TensorListMeta<2>) <= 3900, "metadata too large");
static_assert(sizeof(TensorListMeta<3>) <= 3900 && sizeof(TensorListMeta<4>) <= 3900, "metadata too large");

template <int Depth, typename Body, typename... Args>
__global__ void __launch_bounds__(kBlockThreads) multi_tensor_kernel(TensorListMeta<Depth> meta, Body body, Args... args) {
  body(meta, blockIdx.x, args...);
}

// Fills TensorListMeta from `tensors` and launches `Body` whenever it is full.
template <int Depth, typename Body, typename... Args>
void launch_multi_tensor(const TensorSlots* tensors, int64_t count, cudaStream_t stream, Body body, Args... args) {
  using Meta = TensorListMeta<Depth>;
  Meta meta;
  int n_tensors = 0;
  int n_blocks = 0;
  for (int64_t t = 0; t < count; ++t) {
    if (tensors[t].numel == 0) continue;
    for (int d = 0; d < Depth; ++d) meta.ptr[d][n_tensors] = tensors[t].ptr[d];
    meta.numel[n_tensors] = tensors[t].numel;
    meta.index[n_tensors] = tensors[t].index;
    ++n_tensors;
    const int64_t chunks = (tensors[t].numel + kChunkElements - 1) / kChunkElements;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[n_blocks] = static_cast<unsigned char>(n_tensors - 1);
      meta.block_to_chunk[n_blocks] = static_cast<int>(c);
      ++n_blocks;
      const bool last_chunk = c == chunks - 1;
      const bool full = n_blocks == Meta::kMaxBlocks || (last_chunk && n_tensors == Meta::kMaxTensors);
      if (full || (last_chunk && t == count - 1)) {
        multi_tensor_kernel<Depth><<<n_blocks, kBlockThreads, 0, stream>>>(meta, body, args...);
        n_blocks = 0;
        if (last_chunk) {
          n_tensors = 0;
        } else {  // the current tensor continues in the next launch, as slot 0
          for (int d = 0; d < Depth; ++d) meta.ptr[d][0] = meta.ptr[d][n_tensors - 1];
          meta.numel[0] = meta.numel[n_tensors - 1];
          meta.index[0] = meta.index[n_tensors - 1];
          n_tensors = 1;
        }
      }
    }
  }
  if (n_blocks > 0) multi_tensor_kernel<Depth><<<n_blocks, kBlockThreads, 0, stream>>>(meta, body, args...);
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
