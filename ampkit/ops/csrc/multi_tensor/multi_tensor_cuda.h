// Launchers of the ampkit_multi_tensor CUDA kernels (defined in multi_tensor_kernels.cu). They take
// raw pointers grouped by dtype, so this header and the .cu need no ATen; multi_tensor_cuda.cpp
// does the tensor-level checks and grouping. `vectorize` (AMPKIT_CUDA_KERNELS=multi_tensor, kernel_choice.h)
// moves aligned chunks kVectorElements at a time; without it every element is loaded on its own.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/multi_tensor_cuda_types.h"

namespace ampkit {
namespace cuda {

// slots: ptr[0] = input, ptr[1] = output.
void launch_scale(const TensorSlots* tensors, int64_t count, Dtype in, Dtype out, double factor, FlagRef flag,
                  bool vectorize, cudaStream_t stream);

// slots: ptr[0] = x, ptr[1] = y (dtype `in`), ptr[2] = out.
void launch_axpby(const TensorSlots* tensors, int64_t count, Dtype in, Dtype out, double a, double b,
                  int arg_to_check, FlagRef flag, bool vectorize, cudaStream_t stream);

// slots: ptr[0] = new (dtype `in`), ptr[1] = stash (dtype `out`, or nullptr), ptr[2] = out.
void launch_combine(const TensorSlots* tensors, int64_t count, Dtype in, Dtype out, double inv_scale, FlagRef flag,
                    bool vectorize, cudaStream_t stream);

// Adds the sum of squares of (input * factor) per tensor into sumsq[index] (double, zeroed by the
// caller); with check, raises the flag on a non-finite input; with write, writes input * factor to ptr[1]
// (said by the caller: an empty first tensor may have no address).
void launch_sum_squares(const TensorSlots* tensors, int64_t count, Dtype in, Dtype out, double factor, bool check,
                        FlagRef flag, double* sumsq, bool write, bool vectorize, cudaStream_t stream);

// total = sqrt(sum sumsq), per_tensor[i] = sqrt(sumsq[i]) (if per_tensor != nullptr), in dtype `out`.
void launch_finish_norms(const double* sumsq, int64_t count, Dtype out, void* total, void* per_tensor,
                         cudaStream_t stream);

}  // namespace cuda
}  // namespace ampkit
