// Raw-pointer launchers of the LayerNorm/RMSNorm CUDA kernels (norms_cuda.cu), called by the CUDA
// registration (norms_cuda.cpp). Same arguments as CpuKernels in norms_cpu.cpp; each returns the
// launch status for the caller to check.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ampkit {
namespace norms {
namespace cuda {

// Partial weight/bias-gradient rows written by launch_backward (reduced by the caller).
int64_t param_grad_chunks(int64_t rows, int64_t n);

template <typename in_t, typename out_t, bool kRms, typename acc_t>
cudaError_t launch_forward(const in_t* x, const acc_t* w, const acc_t* b, out_t* y, acc_t* mean, acc_t* rstd,
                           int64_t rows, int64_t n, double eps, cudaStream_t stream);

template <typename in_t, typename out_t, typename saved_t, bool kRms, bool kFromOutput, typename acc_t>
cudaError_t launch_backward(const out_t* dy, const saved_t* saved, const acc_t* mean, const acc_t* rstd,
                            const acc_t* w, const acc_t* b, in_t* dx, acc_t* dw_partial, acc_t* db_partial,
                            int64_t rows, int64_t n, int64_t chunks, cudaStream_t stream);

}  // namespace cuda
}  // namespace norms
}  // namespace ampkit
