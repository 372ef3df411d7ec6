// Host-side plumbing shared by the CPU and CUDA optimizer dispatch: argument checks that name the
// offending list, step counters (one-element tensors; bump_steps advances those in host memory), and dtype
// dispatch over (parameter, gradient) pairs. No parallel loops and no device code here.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace ampkit {
namespace optim {

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// Validates the lists of one multi-tensor optimizer call against `params` (the list that defines the
// number of tensors, their sizes and strides). Every message names the op and the list. The lists checked are
// remembered for the call, so that GradScaler's tensors (checked last, `scaling`) are checked against each.
class ListChecker {
 public:
  // `device_type`: where this kernel runs (CPU or CUDA); every list must sit on params[0]'s device.
  ListChecker(const char* op, at::TensorList params, c10::DeviceType device_type = c10::DeviceType::CPU)
      : op_(op), params_(params) {
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      TORCH_CHECK(p.device().type() == device_type, op_, ": params[", i, "] is on ", p.device(),
                  "; this kernel runs on ", c10::DeviceTypeName(device_type, /*lower_case=*/true),
                  " tensors only");
      TORCH_CHECK(p.device() == params[0].device(), op_, ": params must share one device; params[0] is on ",
                  params[0].device(), " but params[", i, "] is on ", p.device());
      TORCH_CHECK(is_supported_float(p.scalar_type()), op_, ": params[", i, "] has dtype ", p.scalar_type(),
                  "; expected float32, float64, float16 or bfloat16");
      TORCH_CHECK(p.scalar_type() == params[0].scalar_type(), op_, ": params must share one dtype; params[0] is ",
                  params[0].scalar_type(), " but params[", i, "] is ", p.scalar_type());
      TORCH_CHECK(p.is_non_overlapping_and_dense(), op_, ": params[", i,
                  "] is not dense (a strided view); pass contiguous or dense tensors");
    }
  }

  at::ScalarType param_dtype() const { return params_.empty() ? at::kFloat : params_[0].scalar_type(); }

  // The accumulate dtype state tensors must have: float64 for float64 params, else float32.
  at::ScalarType acc_dtype() const { return param_dtype() == at::kDouble ? at::kDouble : at::kFloat; }

  // A list matched element-wise to params: same length, sizes and strides, dtype `dtype`.
  void same_layout(const char* name, at::TensorList list, at::ScalarType dtype) const {
    TORCH_CHECK(list.size() == params_.size(), op_, ": ", name, " has ", list.size(), " tensors but params has ",
                params_.size());
    checked_.emplace_back(name, list);
    for (size_t i = 0; i < list.size(); ++i) {
      const at::Tensor& t = list[i];
      TORCH_CHECK(t.device() == params_[i].device(), op_, ": ", name, "[", i, "] is on ", t.device(), "; expected ",
                  params_[i].device());
      TORCH_CHECK(t.scalar_type() == dtype, op_, ": ", name, "[", i, "] has dtype ", t.scalar_type(), "; expected ",
                  dtype);
      TORCH_CHECK(t.sizes() == params_[i].sizes(), op_, ": ", name, "[", i, "] has shape ", t.sizes(),
                  " but params[", i, "] has shape ", params_[i].sizes());
      TORCH_CHECK(t.strides() == params_[i].strides(), op_, ": ", name, "[", i, "] has strides ", t.strides(),
                  " but params[", i, "] has strides ", params_[i].strides(),
                  "; pass tensors laid out like their parameter");
    }
  }

  // Gradients: the parameter dtype, or float32 for float16/bfloat16 parameters. Returns their dtype.
  at::ScalarType grads(at::TensorList grads) const {
    const at::ScalarType g = grads.empty() ? param_dtype() : grads[0].scalar_type();
    const bool ok = g == param_dtype() || (g == at::kFloat && acc_dtype() == at::kFloat);
    TORCH_CHECK(ok, op_, ": grads have dtype ", g, " but params have ", param_dtype(),
                "; expected the parameter dtype or float32");
    same_layout("grads", grads, g);
    return g;
  }

  void state(const char* name, at::TensorList list) const { same_layout(name, list, acc_dtype()); }

  // Optional list: empty, or matched to params.
  void optional_state(const char* name, at::TensorList list, bool required) const {
    if (required) {
      state(name, list);
    } else {
      TORCH_CHECK(list.empty(), op_, ": ", name, " must be empty for these options; got ", list.size(), " tensors");
    }
  }

  // fp32 master copies: empty, or one per float16/bfloat16 parameter.
  bool master(at::TensorList master_params) const {
    if (master_params.empty()) return false;
    TORCH_CHECK(param_dtype() == at::kHalf || param_dtype() == at::kBFloat16, op_,
                ": master_params are only meaningful for float16/bfloat16 params, but params are ", param_dtype());
    same_layout("master_params", master_params, at::kFloat);
    return true;
  }

  // Step counters the kernel reads where it runs: one-element tensors on the params' device (float32, or
  // float64 on the CPU), so a CUDA kernel can skip a step and leave its count unchanged without a host read.
  void steps(at::TensorList steps) const {
    count("steps", steps);
    checked_.emplace_back("steps", steps);
    for (size_t i = 0; i < steps.size(); ++i) {
      const at::Tensor& s = steps[i];
      const bool ok_dtype = s.scalar_type() == at::kFloat || (s.is_cpu() && s.scalar_type() == at::kDouble);
      TORCH_CHECK(s.device() == params_[i].device() && s.numel() == 1 && ok_dtype, op_, ": steps[", i,
                  "] must be a one-element float32 tensor on ", params_[i].device(),
                  " (the params' device); got ", s.scalar_type(), " of shape ", s.sizes(), " on ", s.device());
    }
  }

  // Step counters read on the host (LAMB, whose trust ratios are host numbers anyway).
  void host_steps(at::TensorList steps) const {
    count("steps", steps);
    checked_.emplace_back("steps", steps);
    for (size_t i = 0; i < steps.size(); ++i) {
      const at::Tensor& s = steps[i];
      TORCH_CHECK(s.device().is_cpu() && s.numel() == 1 &&
                      (s.scalar_type() == at::kFloat || s.scalar_type() == at::kDouble),
                  op_, ": steps[", i, "] must be a one-element float32/float64 CPU tensor; got ", s.scalar_type(),
                  " of shape ", s.sizes(), " on ", s.device());
    }
  }

  // torch's GradScaler contract: `grad_scale` and `found_inf` are absent or one-element float32 tensors on
  // the params' device, sharing memory with no tensor of the call (checked after every list).
  void scaling(const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) const {
    scalar("grad_scale", grad_scale);
    scalar("found_inf", found_inf);
    apart("grad_scale", grad_scale);
    apart("found_inf", found_inf);
  }

  std::vector<int64_t> numels() const {
    std::vector<int64_t> n(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) n[i] = params_[i].numel();
    return n;
  }

 private:
  void count(const char* name, at::TensorList list) const {
    TORCH_CHECK(list.size() == params_.size(), op_, ": ", name, " has ", list.size(), " tensors but params has ",
                params_.size());
  }

  void scalar(const char* name, const std::optional<at::Tensor>& t) const {
    if (!t.has_value() || params_.empty()) return;
    TORCH_CHECK(t->numel() == 1 && t->scalar_type() == at::kFloat && t->device() == params_[0].device(), op_, ": ",
                name, " must be a one-element float32 tensor on ", params_[0].device(), " (the params' device); got ",
                t->scalar_type(), " of shape ", t->sizes(), " on ", t->device());
  }

  // The kernels read `t` while they write every list (the unscaled gradients too), in parallel chunks: one that is
  // part of a parameter, a gradient or a counter would be read before or after a chunk wrote it.
  void apart(const char* name, const std::optional<at::Tensor>& t) const {
    if (!t.has_value()) return;
    apart_from(name, *t, "params", params_);
    for (const auto& [list_name, list] : checked_) apart_from(name, *t, list_name, list);
  }

  void apart_from(const char* name, const at::Tensor& t, const char* list_name, at::TensorList list) const {
    for (size_t i = 0; i < list.size(); ++i) {
      const at::MemOverlapStatus status = at::get_overlap_status(t, list[i]);
      TORCH_CHECK(status == at::MemOverlapStatus::No || status == at::MemOverlapStatus::TooHard, op_, ": ", name,
                  " shares memory with ", list_name, "[", i,
                  "], which the step writes (torch: some elements of the input tensor and the written-to tensor "
                  "refer to a single memory location); pass a ",
                  name, " of its own, e.g. its clone()");
    }
  }

  const char* op_;
  at::TensorList params_;
  mutable std::vector<std::pair<const char*, at::TensorList>> checked_;  // (name, list) of each list checked
};

// Adds one to a step counter and returns the new value.
inline double bump_step(const at::Tensor& step) {
  if (step.scalar_type() == at::kDouble) {
    double* s = step.data_ptr<double>();
    *s += 1.0;
    return *s;
  }
  float* s = step.data_ptr<float>();
  *s += 1.0f;
  return static_cast<double>(*s);
}

template <typename T>
struct TypeTag {
  using type = T;
};

template <typename param_t>
using acc_type_for = std::conditional_t<std::is_same<param_t, double>::value, double, float>;

// Calls f(TypeTag<param_t>{}, TypeTag<grad_t>{}) for the supported (param, grad) dtype pairs.
// Adds one to every step counter; returns the new values.
inline std::vector<double> bump_steps(at::TensorList steps) {
  std::vector<double> values;
  values.reserve(steps.size());
  for (const at::Tensor& s : steps) values.push_back(bump_step(s));
  return values;
}

// A float64 CPU vector with one entry per tensor (LAMB's lr x trust ratios, NovoGrad's denominators),
// read on the host by the CPU and CUDA kernels alike.
inline const double* per_tensor_values(const char* op, const char* name, const at::Tensor& values, size_t n) {
  TORCH_CHECK(values.device().is_cpu() && values.scalar_type() == at::kDouble && values.dim() == 1 &&
                  values.numel() == static_cast<int64_t>(n) && values.is_contiguous(),
              op, ": ", name, " must be a contiguous float64 CPU vector with one entry per param (", n, "); got ",
              values.scalar_type(), " of shape ", values.sizes(), " on ", values.device());
  return values.data_ptr<double>();
}

template <class F>
void dispatch_param_grad(at::ScalarType param, at::ScalarType grad, const F& f) {
  switch (param) {
    case at::kDouble:
      return f(TypeTag<double>{}, TypeTag<double>{});
    case at::kFloat:
      return f(TypeTag<float>{}, TypeTag<float>{});
    case at::kHalf:
      if (grad == at::kFloat) return f(TypeTag<c10::Half>{}, TypeTag<float>{});
      return f(TypeTag<c10::Half>{}, TypeTag<c10::Half>{});
    case at::kBFloat16:
      if (grad == at::kFloat) return f(TypeTag<c10::BFloat16>{}, TypeTag<float>{});
      return f(TypeTag<c10::BFloat16>{}, TypeTag<c10::BFloat16>{});
    default:
      TORCH_CHECK(false, "ampkit optimizers: unsupported parameter dtype ", param);
  }
}

// Calls f(std::integral_constant<bool, b>{}) with a runtime flag turned into a compile-time one.
template <class F>
void dispatch_bool(bool b, const F& f) {
  if (b) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

template <typename T>
inline T* ptr(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

template <typename T>
inline T* ptr_or_null(at::TensorList list, size_t i) {
  return list.empty() ? nullptr : static_cast<T*>(list[i].data_ptr());
}

}  // namespace optim
}  // namespace ampkit
