// CUDA registration of the ampkit_norms ops: norm_ops.h's tensor-level functions with the kernels of
// norms_cuda.cu, run on the input's device and current stream. Compiled only where torch sees CUDA.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "norm_ops.h"
#include "norms_cuda.h"

namespace ampkit {
namespace norms {
namespace {

struct CudaKernels {
  static int64_t param_grad_chunks(int64_t rows, int64_t n) { return cuda::param_grad_chunks(rows, n); }

  template <typename in_t, typename out_t, bool kRms, typename acc_t>
  static void forward(const in_t* x, const acc_t* w, const acc_t* b, out_t* y, acc_t* mean, acc_t* rstd,
                      int64_t rows, int64_t n, double eps) {
    C10_CUDA_CHECK((cuda::launch_forward<in_t, out_t, kRms, acc_t>(x, w, b, y, mean, rstd, rows, n, eps,
                                                                   c10::cuda::getCurrentCUDAStream())));
  }

  template <typename in_t, typename out_t, typename saved_t, bool kRms, bool kFromOutput, typename acc_t>
  static void backward(const out_t* dy, const saved_t* saved, const acc_t* mean, const acc_t* rstd, const acc_t* w,
                       const acc_t* b, in_t* dx, acc_t* dw_partial, acc_t* db_partial, int64_t rows, int64_t n,
                       int64_t chunks) {
    C10_CUDA_CHECK((cuda::launch_backward<in_t, out_t, saved_t, kRms, kFromOutput, acc_t>(
        dy, saved, mean, rstd, w, b, dx, dw_partial, db_partial, rows, n, chunks,
        c10::cuda::getCurrentCUDAStream())));
  }
};

std::tuple<Tensor, Tensor, Tensor> layer_norm_fwd_cuda(const Tensor& input, at::IntArrayRef normalized_shape,
                                                       const std::optional<Tensor>& weight,
                                                       const std::optional<Tensor>& bias, double eps,
                                                       std::optional<at::ScalarType> out_dtype) {
  const c10::cuda::CUDAGuard guard(input.device());
  return layer_norm_fwd<CudaKernels>(input, normalized_shape, weight, bias, eps, out_dtype);
}

std::tuple<Tensor, Tensor> rms_norm_fwd_cuda(const Tensor& input, at::IntArrayRef normalized_shape,
                                             const std::optional<Tensor>& weight, double eps,
                                             std::optional<at::ScalarType> out_dtype) {
  const c10::cuda::CUDAGuard guard(input.device());
  return rms_norm_fwd<CudaKernels>(input, normalized_shape, weight, eps, out_dtype);
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_bwd_cuda(const Tensor& grad_out, const Tensor& saved,
                                                       const Tensor& mean, const Tensor& rstd,
                                                       at::IntArrayRef normalized_shape,
                                                       const std::optional<Tensor>& weight,
                                                       const std::optional<Tensor>& bias, bool memory_efficient,
                                                       at::ScalarType input_dtype) {
  const c10::cuda::CUDAGuard guard(saved.device());
  return layer_norm_bwd<CudaKernels>(grad_out, saved, mean, rstd, normalized_shape, weight, bias, memory_efficient,
                                     input_dtype);
}

std::tuple<Tensor, Tensor> rms_norm_bwd_cuda(const Tensor& grad_out, const Tensor& saved, const Tensor& rstd,
                                             at::IntArrayRef normalized_shape, const std::optional<Tensor>& weight,
                                             bool memory_efficient, at::ScalarType input_dtype) {
  const c10::cuda::CUDAGuard guard(saved.device());
  return rms_norm_bwd<CudaKernels>(grad_out, saved, rstd, normalized_shape, weight, memory_efficient, input_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(ampkit_norms, CUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cuda);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cuda);
  m.impl("rms_norm_fwd", &rms_norm_fwd_cuda);
  m.impl("rms_norm_bwd", &rms_norm_bwd_cuda);
}

}  // namespace norms
}  // namespace ampkit
