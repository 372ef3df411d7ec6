// CUDA registration of the ampkit_multi_tensor ops: the same checks as the CPU path, tensors grouped
// by dtype pair, raw pointers handed to the launchers in multi_tensor_kernels.cu. Compiled only when
// torch sees a GPU at build time (ampkit.ops._build passes it as a CUDA source).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "common/contiguous.h"
#include "common/kernel_choice.h"
#include "multi_tensor/multi_tensor_checks.h"
#include "multi_tensor/multi_tensor_cuda.h"

namespace ampkit {
namespace {

using cuda::Dtype;
using cuda::TensorSlots;
using Groups = std::map<std::pair<Dtype, Dtype>, std::vector<TensorSlots>>;

bool vectorize() { return cuda_kernels() == CudaKernels::kMultiTensor; }

Dtype to_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return Dtype::kFloat;
    case at::kHalf:
      return Dtype::kHalf;
    case at::kBFloat16:
      return Dtype::kBFloat16;
    case at::kDouble:
      return Dtype::kDouble;
    default:
      TORCH_CHECK(false, "ampkit_multi_tensor: unsupported dtype ", type);
  }
}

cuda::FlagRef flag_ref(const at::Tensor& flag) {
  return {flag.data_ptr(), flag.scalar_type() == at::kFloat};
}

void* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr() : nullptr;
}

// Adds tensor i to the group of its (slot 0 dtype, output dtype).
void add(Groups& groups, const at::Tensor& in, at::ScalarType out_dtype, std::initializer_list<void*> ptrs,
         int64_t index) {
  TensorSlots slots{{}, in.numel(), index};
  int d = 0;
  for (void* p : ptrs) slots.ptr[d++] = p;
  groups[{to_dtype(in.scalar_type()), to_dtype(out_dtype)}].push_back(slots);
}

void scale_cuda(at::TensorList inputs, at::TensorList outputs, double scale, const at::Tensor& found_inf) {
  check_scale_args("ampkit_multi_tensor.scale_", inputs, outputs, found_inf);
  const c10::cuda::CUDAGuard guard(found_inf.device());
  const auto in = contiguous_inputs(inputs);
  OutputBuffers out(outputs);
  Groups groups;
  for (size_t i = 0; i < in.size(); ++i) {
    const at::Tensor& o = out.tensors()[i];
    add(groups, in[i], o.scalar_type(), {in[i].data_ptr(), o.data_ptr()}, i);
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const bool vec = vectorize();
  for (const auto& [types, slots] : groups) {
    cuda::launch_scale(slots.data(), slots.size(), types.first, types.second, scale, flag_ref(found_inf), vec,
                       stream);
  }
  out.finish();
}

void axpby_cuda(at::TensorList x, at::TensorList y, at::TensorList out, double a, double b, int64_t arg_to_check,
                const at::Tensor& found_inf) {
  check_axpby_args("ampkit_multi_tensor.axpby_", x, y, out, arg_to_check, found_inf);
  const c10::cuda::CUDAGuard guard(found_inf.device());
  const auto xs = contiguous_inputs(x);
  const auto ys = contiguous_inputs(y);
  OutputBuffers outs(out);
  Groups groups;
  for (size_t i = 0; i < xs.size(); ++i) {
    const at::Tensor& o = outs.tensors()[i];
    add(groups, xs[i], o.scalar_type(), {xs[i].data_ptr(), ys[i].data_ptr(), o.data_ptr()}, i);
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const bool vec = vectorize();
  for (const auto& [types, slots] : groups) {
    cuda::launch_axpby(slots.data(), slots.size(), types.first, types.second, a, b, static_cast<int>(arg_to_check),
                       flag_ref(found_inf), vec, stream);
  }
  outs.finish();
}

void combine_cuda(at::TensorList fresh, const c10::List<std::optional<at::Tensor>>& stash, at::TensorList out,
                  double inv_scale, const at::Tensor& found_inf) {
  const auto stashed = check_combine_args("ampkit_multi_tensor.combine_", fresh, stash, out, found_inf);
  const c10::cuda::CUDAGuard guard(found_inf.device());
  const auto fresh_c = contiguous_inputs(fresh);
  OutputBuffers outs(out);
  Groups groups;
  for (size_t i = 0; i < fresh_c.size(); ++i) {
    const at::Tensor& o = outs.tensors()[i];
    add(groups, fresh_c[i], o.scalar_type(), {fresh_c[i].data_ptr(), ptr_or_null(stashed[i]), o.data_ptr()}, i);
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const bool vec = vectorize();
  for (const auto& [types, slots] : groups) {
    cuda::launch_combine(slots.data(), slots.size(), types.first, types.second, inv_scale, flag_ref(found_inf),
                         vec, stream);
  }
  outs.finish();
}

std::tuple<at::Tensor, at::Tensor> norms_cuda(at::TensorList inputs, at::TensorList outputs, double factor,
                                              const at::Tensor* found_inf, bool per_tensor) {
  const at::Device device = inputs.empty() ? found_inf->device() : inputs[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const auto in = contiguous_inputs(inputs);
  OutputBuffers outs(outputs);
  const bool write = !outputs.empty();
  Groups groups;
  for (size_t i = 0; i < in.size(); ++i) {
    const at::Tensor& o = write ? outs.tensors()[i] : in[i];
    add(groups, in[i], o.scalar_type(), {in[i].data_ptr(), write ? o.data_ptr() : nullptr}, i);
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const bool vec = vectorize();
  const auto options = at::TensorOptions().device(device);
  at::Tensor sumsq = at::zeros({static_cast<int64_t>(in.size())}, options.dtype(at::kDouble));
  const cuda::FlagRef flag = found_inf ? flag_ref(*found_inf) : cuda::FlagRef{nullptr, true};
  for (const auto& [types, slots] : groups) {
    cuda::launch_sum_squares(slots.data(), slots.size(), types.first, types.second, factor, found_inf != nullptr,
                             flag, sumsq.data_ptr<double>(), write, vec, stream);
  }
  outs.finish();
  const auto out_dtype = norm_dtype(inputs);
  at::Tensor total = at::empty({}, options.dtype(out_dtype));
  at::Tensor per = at::empty({per_tensor ? static_cast<int64_t>(in.size()) : 0}, options.dtype(out_dtype));
  cuda::launch_finish_norms(sumsq.data_ptr<double>(), sumsq.numel(), to_dtype(out_dtype), total.data_ptr(),
                            per_tensor ? per.data_ptr() : nullptr, stream);
  return {total, per};
}

std::tuple<at::Tensor, at::Tensor> l2norm_cuda(at::TensorList inputs, bool per_tensor) {
  TORCH_CHECK(!inputs.empty(), "ampkit_multi_tensor.l2norm: `inputs` is empty (the Python frontend handles that)");
  check_list("ampkit_multi_tensor.l2norm", inputs, "inputs", inputs[0].device());
  return norms_cuda(inputs, {}, 1.0, nullptr, per_tensor);
}

std::tuple<at::Tensor, at::Tensor> unscale_l2norm_cuda(at::TensorList inputs, at::TensorList outputs,
                                                       double inv_scale, const at::Tensor& found_inf,
                                                       bool per_tensor) {
  check_unscale_l2norm_args("ampkit_multi_tensor.unscale_l2norm", inputs, outputs, found_inf);
  return norms_cuda(inputs, outputs, inv_scale, &found_inf, per_tensor);
}

}  // namespace
}  // namespace ampkit

TORCH_LIBRARY_IMPL(ampkit_multi_tensor, CUDA, m) {
  m.impl("scale_", &ampkit::scale_cuda);
  m.impl("axpby_", &ampkit::axpby_cuda);
  m.impl("combine_", &ampkit::combine_cuda);
  m.impl("l2norm", &ampkit::l2norm_cuda);
  m.impl("unscale_l2norm", &ampkit::unscale_l2norm_cuda);
}
