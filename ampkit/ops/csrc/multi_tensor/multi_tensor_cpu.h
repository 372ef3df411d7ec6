// CPU implementations of the ampkit_multi_tensor ops (registered in multi_tensor_ops.cpp).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace ampkit {

void scale_cpu(at::TensorList inputs, at::TensorList outputs, double scale, const at::Tensor& found_inf);

void axpby_cpu(at::TensorList x, at::TensorList y, at::TensorList out, double a, double b, int64_t arg_to_check,
               const at::Tensor& found_inf);

void combine_cpu(at::TensorList fresh, const c10::List<std::optional<at::Tensor>>& stash, at::TensorList out,
                 double inv_scale, const at::Tensor& found_inf);

std::tuple<at::Tensor, at::Tensor> l2norm_cpu(at::TensorList inputs, bool per_tensor);

std::tuple<at::Tensor, at::Tensor> unscale_l2norm_cpu(at::TensorList inputs, at::TensorList outputs, double inv_scale,
                                                      const at::Tensor& found_inf, bool per_tensor);

// The launch table plan_chunks (common/chunk_plan.h) makes for tensors of `numels` elements whose slot addresses
// are addresses[t * depth + d] (depth = len(element_bytes)): rows (launch, tensor, vectorized) and rows
// (launch, tensor within the launch, chunk).
std::tuple<at::Tensor, at::Tensor> chunk_plan_cpu(c10::IntArrayRef numels, c10::IntArrayRef addresses,
                                                  c10::IntArrayRef element_bytes);

// The kernels AMPKIT_CUDA_KERNELS selects: "per_tensor" or "multi_tensor" (an invalid value raises).
std::string cuda_kernels_cpu();

}  // namespace ampkit
