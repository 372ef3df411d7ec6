// Which CUDA kernels run the ops that have two: `AMPKIT_CUDA_KERNELS`, read at every call so a process (or a test)
// can switch. `per_tensor` (the default) keeps the kernels a GPU run has verified: the optimizers' one launch per
// tensor and the multi-tensor ops' element-at-a-time loops. `multi_tensor` selects the chunked multi-tensor
// optimizer kernels and the vectorized multi-tensor loops (and, in ampkit.ops' Python, AdamP's CUDA kernel), which
// stay opt-in until `bash .ci/gpu tests` passes with them on a GPU and benchmarks/ops_cuda.py shows them faster.
// Plain C++: the CPU build exposes it too.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace ampkit {

enum class CudaKernels { kPerTensor, kMultiTensor };

inline const char* kCudaKernelsEnv = "AMPKIT_CUDA_KERNELS";

inline CudaKernels cuda_kernels() {
  const char* raw = std::getenv(kCudaKernelsEnv);
  const std::string value = raw == nullptr ? "" : raw;
  if (value.empty() || value == "per_tensor") return CudaKernels::kPerTensor;
  if (value == "multi_tensor") return CudaKernels::kMultiTensor;
  TORCH_CHECK(false, kCudaKernelsEnv, "='", value, "' is not valid; use per_tensor (the default) or multi_tensor");
}

inline const char* cuda_kernels_name(CudaKernels choice) {
  return choice == CudaKernels::kMultiTensor ? "multi_tensor" : "per_tensor";
}

}  // namespace ampkit
