// Schemas of the ampkit_multi_tensor ops and their CPU registration. The CUDA kernels register
// themselves in multi_tensor_cuda.cpp, built only where torch sees a GPU.
#include <torch/library.h>

#include "multi_tensor/multi_tensor_cpu.h"

TORCH_LIBRARY(ampkit_multi_tensor, m) {
  m.def("scale_(Tensor[] inputs, Tensor(a!)[] out, float scale, Tensor(b!) found_inf) -> ()");
  m.def(
      "axpby_(Tensor[] x, Tensor[] y, Tensor(a!)[] out, float a, float b, int arg_to_check, "
      "Tensor(b!) found_inf) -> ()");
  m.def("combine_(Tensor[] new, Tensor?[] stash, Tensor(a!)[] out, float inv_scale, Tensor(b!) found_inf) -> ()");
  m.def("l2norm(Tensor[] inputs, bool per_tensor) -> (Tensor, Tensor)");
  m.def(
      "unscale_l2norm(Tensor[] inputs, Tensor(a!)[] out, float inv_scale, Tensor(b!) found_inf, "
      "bool per_tensor) -> (Tensor, Tensor)");
  // The CUDA launchers' host-side decisions, run on the CPU (launch_plan_cpu.cpp).
  m.def("chunk_plan(int[] numels, int[] addresses, int[] element_bytes) -> (Tensor, Tensor)", &ampkit::chunk_plan_cpu);
  m.def("cuda_kernels() -> str", &ampkit::cuda_kernels_cpu);
}

TORCH_LIBRARY_IMPL(ampkit_multi_tensor, CPU, m) {
  m.impl("scale_", &ampkit::scale_cpu);
  m.impl("axpby_", &ampkit::axpby_cpu);
  m.impl("combine_", &ampkit::combine_cpu);
  m.impl("l2norm", &ampkit::l2norm_cpu);
  m.impl("unscale_l2norm", &ampkit::unscale_l2norm_cpu);
}
