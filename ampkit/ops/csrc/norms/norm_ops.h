// Tensor-level LayerNorm/RMSNorm ops shared by the CPU and CUDA registrations: argument checks,
// output allocation, dtype dispatch, and the final reduction of the weight/bias gradient partials.
// `Kernels` supplies the device loops (CpuKernels in norms_cpu.cpp, CudaKernels in norms_cuda.cpp):
//   static int64_t param_grad_chunks(rows, n);          // partial dw/db rows the backward writes
//   template <in_t, out_t, kRms> static void forward(x, w, b, y, mean, rstd, rows, n, eps);
//   template <in_t, out_t, saved_t, kRms, kFromOutput> static void backward(
//       dy, saved, mean, rstd, w, b, dx, dw_partial, db_partial, rows, n, chunks);
// Weight and bias reach the kernels as contiguous acc_t arrays (ones/zeros when absent).
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <type_traits>

namespace ampkit {
namespace norms {

using at::Tensor;

// Product of the trailing dims of `input` named by normalized_shape (checked).
inline int64_t normalized_numel(const Tensor& input, at::IntArrayRef normalized_shape, const char* input_name) {
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK(k >= 1, "ampkit_norms: normalized_shape must name at least one dimension, got ", normalized_shape);
  TORCH_CHECK(input.dim() >= k, "ampkit_norms: ", input_name, " with shape ", input.sizes(),
              " has fewer dimensions than normalized_shape ", normalized_shape);
  TORCH_CHECK(input.sizes().slice(input.dim() - k).equals(normalized_shape), "ampkit_norms: normalized_shape ",
              normalized_shape, " does not match the trailing dimensions of ", input_name, " with shape ",
              input.sizes());
  int64_t n = 1;
  for (int64_t s : normalized_shape) n *= s;
  return n;
}

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

inline at::ScalarType acc_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// Parameter as a contiguous acc_t array (ones/zeros when absent), after checking shape/device/dtype.
inline Tensor param_as_acc(const std::optional<Tensor>& p, const char* name, const Tensor& input, int64_t n,
                    double fill) {
  const auto acc = acc_dtype(input.scalar_type());
  if (!p.has_value() || !p->defined()) {
    return fill == 0.0 ? at::zeros({n}, input.options().dtype(acc)) : at::ones({n}, input.options().dtype(acc));
  }
  TORCH_CHECK(p->device() == input.device(), "ampkit_norms: ", name, " is on ", p->device(), " but input is on ",
              input.device());
  TORCH_CHECK(p->numel() == n, "ampkit_norms: ", name, " has ", p->numel(), " elements, normalized_shape has ", n);
  TORCH_CHECK(p->scalar_type() == input.scalar_type() || p->scalar_type() == acc,
              "ampkit_norms: ", name, " dtype ", p->scalar_type(), " must be input's dtype ", input.scalar_type(),
              " or ", acc);
  return p->to(acc).contiguous();
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls body(TypeTag<in_t>{}, TypeTag<out_t>{}) for the supported (input, output) dtype pairs.
template <typename Body>
void dispatch_in_out(at::ScalarType in, at::ScalarType out, const char* op, Body&& body) {
  TORCH_CHECK(is_supported_float(in), op, ": input dtype ", in, " is not supported (float32, float64, float16, bfloat16)");
  TORCH_CHECK(out == in || (out == at::kFloat && (in == at::kHalf || in == at::kBFloat16)), op,
              ": output dtype ", out, " must be the input's dtype ", in, " or float32 for half inputs");
  switch (in) {
    case at::kFloat:
      return body(TypeTag<float>{}, TypeTag<float>{});
    case at::kDouble:
      return body(TypeTag<double>{}, TypeTag<double>{});
    case at::kHalf:
      return out == in ? body(TypeTag<at::Half>{}, TypeTag<at::Half>{}) : body(TypeTag<at::Half>{}, TypeTag<float>{});
    case at::kBFloat16:
      return out == in ? body(TypeTag<at::BFloat16>{}, TypeTag<at::BFloat16>{})
                       : body(TypeTag<at::BFloat16>{}, TypeTag<float>{});
    default:
      TORCH_CHECK(false, op, ": unreachable dtype ", in);
  }
}

template <typename Kernels, bool kRms>
std::tuple<Tensor, Tensor, Tensor> norm_forward(const Tensor& input_, at::IntArrayRef normalized_shape,
                                                const std::optional<Tensor>& weight,
                                                const std::optional<Tensor>& bias, double eps,
                                                std::optional<at::ScalarType> out_dtype) {
  const char* op = kRms ? "ampkit_norms::rms_norm_fwd" : "ampkit_norms::layer_norm_fwd";
  const int64_t n = normalized_numel(input_, normalized_shape, "input");
  const Tensor input = input_.contiguous();
  const int64_t rows = n == 0 ? 0 : input.numel() / n;
  const auto in_type = input.scalar_type();
  const auto out_type = out_dtype.value_or(in_type);
  const auto acc = acc_dtype(in_type);
  Tensor out = at::empty(input.sizes(), input.options().dtype(out_type));
  Tensor mean = at::empty({kRms ? 0 : rows}, input.options().dtype(acc));
  Tensor rstd = at::empty({rows}, input.options().dtype(acc));
  TORCH_CHECK(is_supported_float(in_type), op, ": input dtype ", in_type,
              " is not supported (float32, float64, float16, bfloat16)");
  const Tensor w = param_as_acc(weight, "weight", input, n, 1.0);
  const Tensor b = kRms ? Tensor() : param_as_acc(bias, "bias", input, n, 0.0);
  if (rows == 0) return {out, mean, rstd};
  dispatch_in_out(in_type, out_type, op, [&](auto in_tag, auto out_tag) {
      using in_t = typename decltype(in_tag)::type;
      using out_t = typename decltype(out_tag)::type;
    using acc_t = at::opmath_type<in_t>;
    Kernels::template forward<in_t, out_t, kRms>(input.const_data_ptr<in_t>(), w.const_data_ptr<acc_t>(),
                                    kRms ? nullptr : b.const_data_ptr<acc_t>(), out.mutable_data_ptr<out_t>(),
                                    kRms ? nullptr : mean.mutable_data_ptr<acc_t>(),
                                    rstd.mutable_data_ptr<acc_t>(), rows, n, eps);
  });
  return {out, mean, rstd};
}

template <typename Kernels, bool kRms>
std::tuple<Tensor, Tensor, Tensor> norm_backward(const Tensor& grad_out_, const Tensor& saved_, const Tensor& mean,
                                                 const Tensor& rstd, at::IntArrayRef normalized_shape,
                                                 const std::optional<Tensor>& weight,
                                                 const std::optional<Tensor>& bias, bool memory_efficient,
                                                 at::ScalarType input_dtype) {
  const char* op = kRms ? "ampkit_norms::rms_norm_bwd" : "ampkit_norms::layer_norm_bwd";
  const int64_t n = normalized_numel(saved_, normalized_shape, memory_efficient ? "output" : "input");
  TORCH_CHECK(grad_out_.sizes().equals(saved_.sizes()), op, ": grad_output shape ", grad_out_.sizes(),
              " differs from the saved tensor's ", saved_.sizes());
  const Tensor grad_out = grad_out_.contiguous();
  const Tensor saved = saved_.contiguous();
  const int64_t rows = n == 0 ? 0 : saved.numel() / n;
  const auto out_type = grad_out.scalar_type();
  TORCH_CHECK(!memory_efficient || saved.scalar_type() == out_type, op, ": saved output dtype ",
              saved.scalar_type(), " differs from grad_output dtype ", out_type);
  TORCH_CHECK(memory_efficient || saved.scalar_type() == input_dtype, op, ": saved input dtype ",
              saved.scalar_type(), " differs from input_dtype ", input_dtype);
  TORCH_CHECK(is_supported_float(input_dtype), op, ": input dtype ", input_dtype, " is not supported");
  const auto acc = acc_dtype(input_dtype);
  TORCH_CHECK(rstd.scalar_type() == acc && rstd.numel() == rows && rstd.is_contiguous(), op,
              ": rstd must be a contiguous ", acc, " tensor of ", rows, " elements");
  TORCH_CHECK(kRms || memory_efficient || (mean.scalar_type() == acc && mean.numel() == rows && mean.is_contiguous()),
              op, ": mean must be a contiguous ", acc, " tensor of ", rows, " elements");
  // param_as_acc checks dtypes against a tensor of the input's dtype and device.
  const Tensor like_input = at::empty({0}, saved.options().dtype(input_dtype));
  const bool affine = weight.has_value() && weight->defined();
  const bool has_bias = !kRms && bias.has_value() && bias->defined();
  const Tensor w = param_as_acc(weight, "weight", like_input, n, 1.0);
  const Tensor b = kRms ? Tensor() : param_as_acc(bias, "bias", like_input, n, 0.0);
  Tensor dx = at::empty(saved.sizes(), saved.options().dtype(input_dtype));
  const int64_t chunks = Kernels::param_grad_chunks(rows, n);
  Tensor dw_partial = affine ? at::empty({chunks, n}, saved.options().dtype(acc)) : Tensor();
  Tensor db_partial = has_bias ? at::empty({chunks, n}, saved.options().dtype(acc)) : Tensor();
  if (rows > 0) {
    dispatch_in_out(input_dtype, out_type, op, [&](auto in_tag, auto out_tag) {
      using in_t = typename decltype(in_tag)::type;
      using out_t = typename decltype(out_tag)::type;
      using acc_t = at::opmath_type<in_t>;
      const acc_t* mean_ptr = (kRms || memory_efficient) ? nullptr : mean.const_data_ptr<acc_t>();
      acc_t* dwp = affine ? dw_partial.mutable_data_ptr<acc_t>() : nullptr;
      acc_t* dbp = has_bias ? db_partial.mutable_data_ptr<acc_t>() : nullptr;
      const acc_t* b_ptr = kRms ? nullptr : b.const_data_ptr<acc_t>();
      if (memory_efficient) {
        Kernels::template backward<in_t, out_t, out_t, kRms, true>(grad_out.const_data_ptr<out_t>(), saved.const_data_ptr<out_t>(),
                                                      mean_ptr, rstd.const_data_ptr<acc_t>(), w.const_data_ptr<acc_t>(),
                                                      b_ptr, dx.mutable_data_ptr<in_t>(), dwp, dbp, rows, n, chunks);
      } else {
        Kernels::template backward<in_t, out_t, in_t, kRms, false>(grad_out.const_data_ptr<out_t>(), saved.const_data_ptr<in_t>(),
                                                      mean_ptr, rstd.const_data_ptr<acc_t>(), w.const_data_ptr<acc_t>(),
                                                      b_ptr, dx.mutable_data_ptr<in_t>(), dwp, dbp, rows, n, chunks);
      }
    });
  }
  Tensor dw, db;
  if (affine) {
    dw = (rows > 0 ? at::sum(dw_partial, {0}) : at::zeros({n}, w.options())).to(weight->scalar_type());
    dw = dw.view(weight->sizes());
  }
  if (has_bias) {
    db = (rows > 0 ? at::sum(db_partial, {0}) : at::zeros({n}, w.options())).to(bias->scalar_type());
    db = db.view(bias->sizes());
  }
  return {dx, dw, db};
}

template <typename Kernels>
std::tuple<Tensor, Tensor, Tensor> layer_norm_fwd(const Tensor& input, at::IntArrayRef normalized_shape,
                                                  const std::optional<Tensor>& weight,
                                                  const std::optional<Tensor>& bias, double eps,
                                                  std::optional<at::ScalarType> out_dtype) {
  return norm_forward<Kernels, false>(input, normalized_shape, weight, bias, eps, out_dtype);
}

template <typename Kernels>
std::tuple<Tensor, Tensor> rms_norm_fwd(const Tensor& input, at::IntArrayRef normalized_shape,
                                        const std::optional<Tensor>& weight, double eps,
                                        std::optional<at::ScalarType> out_dtype) {
  auto [out, mean, rstd] = norm_forward<Kernels, true>(input, normalized_shape, weight, std::nullopt, eps, out_dtype);
  return {out, rstd};
}

template <typename Kernels>
std::tuple<Tensor, Tensor, Tensor> layer_norm_bwd(const Tensor& grad_out, const Tensor& saved, const Tensor& mean,
                                                  const Tensor& rstd, at::IntArrayRef normalized_shape,
                                                  const std::optional<Tensor>& weight,
                                                  const std::optional<Tensor>& bias, bool memory_efficient,
                                                  at::ScalarType input_dtype) {
  return norm_backward<Kernels, false>(grad_out, saved, mean, rstd, normalized_shape, weight, bias, memory_efficient,
                              input_dtype);
}

template <typename Kernels>
std::tuple<Tensor, Tensor> rms_norm_bwd(const Tensor& grad_out, const Tensor& saved, const Tensor& rstd,
                                        at::IntArrayRef normalized_shape, const std::optional<Tensor>& weight,
                                        bool memory_efficient, at::ScalarType input_dtype) {
  auto [dx, dw, db] = norm_backward<Kernels, true>(grad_out, saved, Tensor(), rstd, normalized_shape, weight, std::nullopt,
                                          memory_efficient, input_dtype);
  return {dx, dw};
}

inline void define_schemas(torch::Library& m) {
  m.def(
      "layer_norm_fwd(Tensor input, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps, "
      "ScalarType? out_dtype) -> (Tensor out, Tensor mean, Tensor rstd)");
  m.def(
      "layer_norm_bwd(Tensor grad_out, Tensor saved, Tensor mean, Tensor rstd, int[] normalized_shape, "
      "Tensor? weight, Tensor? bias, bool memory_efficient, ScalarType input_dtype) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  m.def(
      "rms_norm_fwd(Tensor input, int[] normalized_shape, Tensor? weight, float eps, ScalarType? out_dtype) "
      "-> (Tensor out, Tensor rstd)");
  m.def(
      "rms_norm_bwd(Tensor grad_out, Tensor saved, Tensor rstd, int[] normalized_shape, Tensor? weight, "
      "bool memory_efficient, ScalarType input_dtype) -> (Tensor grad_input, Tensor grad_weight)");
}

template <typename Kernels>
void register_impls(torch::Library& m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd<Kernels>);
  m.impl("layer_norm_bwd", &layer_norm_bwd<Kernels>);
  m.impl("rms_norm_fwd", &rms_norm_fwd<Kernels>);
  m.impl("rms_norm_bwd", &rms_norm_bwd<Kernels>);
}

}  // namespace norms
}  // namespace ampkit
