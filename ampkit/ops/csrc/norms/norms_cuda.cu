// LayerNorm / RMSNorm CUDA kernels. The per-element and per-row math is norm_functors.h, the very
// functors the CPU kernels run (and the CPU tests check); only indexing, reductions and launches are
// CUDA-specific here.
//
// Forward and dx: one block per row, block-wide sums in acc_t. Weight/bias gradients: a second kernel
// over (32-column tile, chunk of rows) writes one partial row per chunk; the caller sums the chunks.
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "norm_functors.h"
#include "norms_cuda.h"

namespace ampkit {
namespace norms {
namespace cuda {
namespace {

constexpr int kRowThreads = 256;
constexpr int kTileCols = 32;
constexpr int kTileRows = 8;

// Sum of v over the block, returned to every thread. `shared` holds one slot per warp.
template <typename acc_t>
__device__ acc_t block_sum(acc_t v, acc_t* shared) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? shared[lane] : acc_t(0);
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  const acc_t total = shared[0];
  __syncthreads();  // shared is reused by the next call
  return total;
}

template <typename in_t, typename out_t, bool kRms, typename acc_t>
__global__ void forward_kernel(const in_t* __restrict__ x, const acc_t* __restrict__ w, const acc_t* __restrict__ b,
                               out_t* __restrict__ y, acc_t* __restrict__ mean_out, acc_t* __restrict__ rstd_out,
                               int64_t n, acc_t eps) {
  __shared__ acc_t shared[32];
  const int64_t row = blockIdx.x;
  const in_t* xr = x + row * n;
  out_t* yr = y + row * n;
  const acc_t inv_n = acc_t(1) / acc_t(n);
  acc_t mean = 0;
  if (!kRms) {
    acc_t sum = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += static_cast<acc_t>(xr[i]);
    mean = block_sum(sum, shared) * inv_n;
  }
  acc_t sq = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const acc_t d = static_cast<acc_t>(xr[i]) - mean;
    sq += d * d;
  }
  const acc_t rstd = rstd_from_variance(block_sum(sq, shared) * inv_n, eps);
  if (threadIdx.x == 0) {
    if (!kRms) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  const NormForward<acc_t> f{mean, rstd};
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    yr[i] = static_cast<out_t>(f(static_cast<acc_t>(xr[i]), w[i], kRms ? acc_t(0) : b[i]));
  }
}

// xhat of element (row, i), from the saved input or the saved output.
template <bool kRms, bool kFromOutput, typename saved_t, typename acc_t>
__device__ inline acc_t normalized(const saved_t* saved, const acc_t* mean, const acc_t* rstd, const acc_t* w,
                                   const acc_t* b, int64_t row, int64_t i, int64_t n) {
  const acc_t s = static_cast<acc_t>(saved[row * n + i]);
  if (kFromOutput) return NormalizedFromOutput<acc_t>{}(s, w[i], kRms ? acc_t(0) : b[i]);
  return NormalizedFromInput<acc_t>{kRms ? acc_t(0) : mean[row], rstd[row]}(s);
}

template <typename in_t, typename out_t, typename saved_t, bool kRms, bool kFromOutput, typename acc_t>
__global__ void input_grad_kernel(const out_t* __restrict__ dy, const saved_t* __restrict__ saved,
                                  const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd,
                                  const acc_t* __restrict__ w, const acc_t* __restrict__ b, in_t* __restrict__ dx,
                                  int64_t n) {
  __shared__ acc_t shared[32];
  const int64_t row = blockIdx.x;
  const out_t* dyr = dy + row * n;
  acc_t sum_g = 0, sum_gxhat = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const acc_t g = static_cast<acc_t>(dyr[i]) * w[i];
    sum_g += g;
    sum_gxhat += g * normalized<kRms, kFromOutput>(saved, mean, rstd, w, b, row, i, n);
  }
  const acc_t inv_n = acc_t(1) / acc_t(n);
  sum_gxhat = block_sum(sum_gxhat, shared);
  sum_g = kRms ? acc_t(0) : block_sum(sum_g, shared);
  const NormInputGrad<acc_t> f{rstd[row], sum_g * inv_n, sum_gxhat * inv_n};
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const acc_t xhat = normalized<kRms, kFromOutput>(saved, mean, rstd, w, b, row, i, n);
    dx[row * n + i] = static_cast<in_t>(f(static_cast<acc_t>(dyr[i]) * w[i], xhat));
  }
}

// Block (kTileCols, kTileRows) sums dy * xhat and dy down its chunk of rows for 32 columns.
template <typename out_t, typename saved_t, bool kRms, bool kFromOutput, typename acc_t>
__global__ void param_grad_partials_kernel(const out_t* __restrict__ dy, const saved_t* __restrict__ saved,
                                           const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd,
                                           const acc_t* __restrict__ w, const acc_t* __restrict__ b,
                                           acc_t* __restrict__ dw_partial, acc_t* __restrict__ db_partial,
                                           int64_t rows, int64_t n, int64_t chunks) {
  __shared__ acc_t tile_w[kTileRows][kTileCols + 1];
  __shared__ acc_t tile_b[kTileRows][kTileCols + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTileCols + threadIdx.x;
  const int64_t row_begin = rows * blockIdx.y / chunks;
  const int64_t row_end = rows * (blockIdx.y + 1) / chunks;
  acc_t acc_w = 0, acc_b = 0;
  if (col < n) {
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += kTileRows) {
      const acc_t d = static_cast<acc_t>(dy[r * n + col]);
      acc_w += d * normalized<kRms, kFromOutput>(saved, mean, rstd, w, b, r, col, n);
      acc_b += d;
    }
  }
  tile_w[threadIdx.y][threadIdx.x] = acc_w;
  tile_b[threadIdx.y][threadIdx.x] = acc_b;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    acc_t total_w = 0, total_b = 0;
    for (int k = 0; k < kTileRows; ++k) {
      total_w += tile_w[k][threadIdx.x];
      total_b += tile_b[k][threadIdx.x];
    }
    dw_partial[blockIdx.y * n + col] = total_w;
    if (db_partial) db_partial[blockIdx.y * n + col] = total_b;
  }
}

}  // namespace

int64_t param_grad_chunks(int64_t rows, int64_t n) {
  (void)n;
  return std::min<int64_t>(std::max<int64_t>(1, rows / 64), 512);
}

template <typename in_t, typename out_t, bool kRms, typename acc_t>
cudaError_t launch_forward(const in_t* x, const acc_t* w, const acc_t* b, out_t* y, acc_t* mean, acc_t* rstd,
                           int64_t rows, int64_t n, double eps, cudaStream_t stream) {
  forward_kernel<in_t, out_t, kRms, acc_t>
      <<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(x, w, b, y, mean, rstd, n, static_cast<acc_t>(eps));
  return cudaGetLastError();
}

template <typename in_t, typename out_t, typename saved_t, bool kRms, bool kFromOutput, typename acc_t>
cudaError_t launch_backward(const out_t* dy, const saved_t* saved, const acc_t* mean, const acc_t* rstd,
                            const acc_t* w, const acc_t* b, in_t* dx, acc_t* dw_partial, acc_t* db_partial,
                            int64_t rows, int64_t n, int64_t chunks, cudaStream_t stream) {
  input_grad_kernel<in_t, out_t, saved_t, kRms, kFromOutput, acc_t>
      <<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(dy, saved, mean, rstd, w, b, dx, n);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess || dw_partial == nullptr) return status;
  const dim3 grid(static_cast<unsigned>((n + kTileCols - 1) / kTileCols), static_cast<unsigned>(chunks));
  param_grad_partials_kernel<out_t, saved_t, kRms, kFromOutput, acc_t><<<grid, dim3(kTileCols, kTileRows), 0, stream>>>(
      dy, saved, mean, rstd, w, b, dw_partial, db_partial, rows, n, chunks);
  return cudaGetLastError();
}

#define AMPKIT_NORMS_INSTANTIATE(in_t, out_t, acc_t)                                                          \
  template cudaError_t launch_forward<in_t, out_t, false, acc_t>(const in_t*, const acc_t*, const acc_t*,        \
                                                                 out_t*, acc_t*, acc_t*, int64_t, int64_t,      \
                                                                 double, cudaStream_t);                         \
  template cudaError_t launch_forward<in_t, out_t, true, acc_t>(const in_t*, const acc_t*, const acc_t*, out_t*, \
                                                                acc_t*, acc_t*, int64_t, int64_t, double,       \
                                                                cudaStream_t);                                  \
  AMPKIT_NORMS_INSTANTIATE_BWD(in_t, out_t, in_t, false, acc_t)                                               \
  AMPKIT_NORMS_INSTANTIATE_BWD(in_t, out_t, out_t, true, acc_t)

#define AMPKIT_NORMS_INSTANTIATE_BWD(in_t, out_t, saved_t, from_output, acc_t)                                \
  template cudaError_t launch_backward<in_t, out_t, saved_t, false, from_output, acc_t>(                        \
      const out_t*, const saved_t*, const acc_t*, const acc_t*, const acc_t*, const acc_t*, in_t*, acc_t*,     \
      acc_t*, int64_t, int64_t, int64_t, cudaStream_t);                                                         \
  template cudaError_t launch_backward<in_t, out_t, saved_t, true, from_output, acc_t>(                         \
      const out_t*, const saved_t*, const acc_t*, const acc_t*, const acc_t*, const acc_t*, in_t*, acc_t*,     \
      acc_t*, int64_t, int64_t, int64_t, cudaStream_t);

AMPKIT_NORMS_INSTANTIATE(float, float, float)
AMPKIT_NORMS_INSTANTIATE(double, double, double)
AMPKIT_NORMS_INSTANTIATE(c10::Half, c10::Half, float)
AMPKIT_NORMS_INSTANTIATE(c10::Half, float, float)
AMPKIT_NORMS_INSTANTIATE(c10::BFloat16, c10::BFloat16, float)
AMPKIT_NORMS_INSTANTIATE(c10::BFloat16, float, float)

}  // namespace cuda
}  // namespace norms
}  // namespace ampkit
