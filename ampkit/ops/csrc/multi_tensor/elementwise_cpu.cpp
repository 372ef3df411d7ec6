// CPU kernels of the element-wise multi-tensor ops: scale_, axpby_, combine_.
#include "common/accumulate.h"
#include "common/dispatch.h"
#include "common/multi_tensor_cpu.h"
#include "multi_tensor/functors.h"
#include "multi_tensor/multi_tensor_checks.h"
#include "multi_tensor/multi_tensor_cpu.h"

namespace ampkit {
namespace {

using cpu::ChunkPlan;
using cpu::NonFiniteFlag;

using cpu::Segment;

template <typename TI, typename TO, typename A>
bool scale_segment(const TI* x, TO* out, int64_t n, ScaleOp<A> op) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const A v = static_cast<A>(x[i]);
    bad |= is_nonfinite(v);
    out[i] = static_cast<TO>(op(v));
  }
  return bad != 0;
}

// kCheck: -1 checks x and y, 0 only x, 1 only y.
template <int kCheck, typename TI, typename TO, typename A>
bool axpby_segment(const TI* x, const TI* y, TO* out, int64_t n, AxpbyOp<A> op) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const A xv = static_cast<A>(x[i]);
    const A yv = static_cast<A>(y[i]);
    if (kCheck != 1) bad |= is_nonfinite(xv);
    if (kCheck != 0) bad |= is_nonfinite(yv);
    out[i] = static_cast<TO>(op(xv, yv));
  }
  return bad != 0;
}

template <typename TI, typename TO, typename A>
bool combine_segment(const TI* fresh, const TO* stash, TO* out, int64_t n, CombineOp<A> op) {
  int bad = 0;
  if (stash == nullptr) {
    const ScaleOp<A> scale{op.inv_scale};
    for (int64_t i = 0; i < n; ++i) {
      const A v = static_cast<A>(fresh[i]);
      bad |= is_nonfinite(v);
      out[i] = static_cast<TO>(scale(v));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const A v = static_cast<A>(fresh[i]);
      bad |= is_nonfinite(v);
      out[i] = static_cast<TO>(op(v, static_cast<A>(stash[i])));
    }
  }
  return bad != 0;
}

// Runs body(TI{}, TO{}) with the C++ types of the input and output dtypes.
template <typename F>
void dispatch_in_out(const at::Tensor& in, const at::Tensor& out, const char* op, F&& body) {
  dispatch_float(in.scalar_type(), op, [&](auto in_tag) {
    dispatch_float(out.scalar_type(), op, [&](auto out_tag) { body(in_tag, out_tag); });
  });
}

}  // namespace

void scale_cpu(at::TensorList inputs, at::TensorList outputs, double scale, const at::Tensor& found_inf) {
  constexpr const char* op = "ampkit_multi_tensor.scale_";
  check_scale_args(op, inputs, outputs, found_inf);

  const auto in = contiguous_inputs(inputs);
  OutputBuffers out(outputs);
  NonFiniteFlag flag;
  ChunkPlan(in).parallel_for_each([&](int64_t, const Segment& s) {
    const at::Tensor& x = in[s.tensor];
    const at::Tensor& y = out.tensors()[s.tensor];
    dispatch_in_out(x, y, op, [&](auto in_tag, auto out_tag) {
      using TI = decltype(in_tag);
      using TO = decltype(out_tag);
      using A = pair_acc_t<TI, TO>;
      flag.note(scale_segment(x.const_data_ptr<TI>() + s.begin, y.data_ptr<TO>() + s.begin, s.length,
                              ScaleOp<A>{static_cast<A>(scale)}));
    });
  });
  out.finish();
  flag.publish(found_inf);
}

void axpby_cpu(at::TensorList x, at::TensorList y, at::TensorList out, double a, double b, int64_t arg_to_check,
               const at::Tensor& found_inf) {
  constexpr const char* op = "ampkit_multi_tensor.axpby_";
  check_axpby_args(op, x, y, out, arg_to_check, found_inf);

  const auto xs = contiguous_inputs(x);
  const auto ys = contiguous_inputs(y);
  OutputBuffers outs(out);
  NonFiniteFlag flag;
  ChunkPlan(xs).parallel_for_each([&](int64_t, const Segment& s) {
    const at::Tensor& o = outs.tensors()[s.tensor];
    dispatch_in_out(xs[s.tensor], o, op, [&](auto in_tag, auto out_tag) {
      using TI = decltype(in_tag);
      using TO = decltype(out_tag);
      using A = pair_acc_t<TI, TO>;
      const TI* xp = xs[s.tensor].const_data_ptr<TI>() + s.begin;
      const TI* yp = ys[s.tensor].const_data_ptr<TI>() + s.begin;
      TO* op_out = o.data_ptr<TO>() + s.begin;
      const AxpbyOp<A> f{static_cast<A>(a), static_cast<A>(b)};
      bool bad = false;
      if (arg_to_check == -1) bad = axpby_segment<-1>(xp, yp, op_out, s.length, f);
      if (arg_to_check == 0) bad = axpby_segment<0>(xp, yp, op_out, s.length, f);
      if (arg_to_check == 1) bad = axpby_segment<1>(xp, yp, op_out, s.length, f);
      flag.note(bad);
    });
  });
  outs.finish();
  flag.publish(found_inf);
}

void combine_cpu(at::TensorList fresh, const c10::List<std::optional<at::Tensor>>& stash, at::TensorList out,
                 double inv_scale, const at::Tensor& found_inf) {
  constexpr const char* op = "ampkit_multi_tensor.combine_";
  const std::vector<at::Tensor> stashed = check_combine_args(op, fresh, stash, out, found_inf);

  const auto fresh_c = contiguous_inputs(fresh);
  OutputBuffers outs(out);
  NonFiniteFlag flag;
  ChunkPlan(fresh_c).parallel_for_each([&](int64_t, const Segment& s) {
    const at::Tensor& o = outs.tensors()[s.tensor];
    const at::Tensor& st = stashed[s.tensor];
    dispatch_in_out(fresh_c[s.tensor], o, op, [&](auto in_tag, auto out_tag) {
      using TI = decltype(in_tag);
      using TO = decltype(out_tag);
      using A = pair_acc_t<TI, TO>;
      const TO* stash_ptr = st.defined() ? st.const_data_ptr<TO>() + s.begin : nullptr;
      flag.note(combine_segment(fresh_c[s.tensor].const_data_ptr<TI>() + s.begin, stash_ptr,
                                o.data_ptr<TO>() + s.begin, s.length, CombineOp<A>{static_cast<A>(inv_scale)}));
    });
  });
  outs.finish();
  flag.publish(found_inf);
}

}  // namespace ampkit
