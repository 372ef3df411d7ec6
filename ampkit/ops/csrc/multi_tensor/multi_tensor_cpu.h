// CPU implementations of the ampkit_multi_tensor ops (registered in multi_tensor_ops.cpp).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
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

}  // namespace ampkit
