// Argument checks of the ampkit_multi_tensor ops, shared by the CPU and CUDA entry points so that
// both raise the same errors (the Python reference mirrors them too).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "common/checks.h"

namespace ampkit {

inline void check_scale_args(const char* op, at::TensorList inputs, at::TensorList outputs, const at::Tensor& flag) {
  check_same_length(op, outputs, "out", inputs.size(), "inputs");
  const auto device = flag.device();
  check_flag(op, flag, "found_inf", device);
  check_list(op, inputs, "inputs", device);
  check_list_like(op, outputs, "out", inputs, device);
  check_writable(op, outputs, "out", inputs, "inputs");
  std::vector<Operand> operands;
  operands.reserve(2 * inputs.size() + 1);
  add_written(operands, outputs, "out");
  add_read(operands, inputs, "inputs", outputs);
  add_flag(operands, flag, "found_inf");
  check_separate(op, operands);
}

inline void check_axpby_args(const char* op, at::TensorList x, at::TensorList y, at::TensorList out,
                             int64_t arg_to_check, const at::Tensor& flag) {
  TORCH_CHECK(arg_to_check >= -1 && arg_to_check <= 1, op, ": `arg_to_check` is ", arg_to_check,
              "; expected -1 (check x and y), 0 (check x) or 1 (check y)");
  check_same_length(op, y, "y", x.size(), "x");
  check_same_length(op, out, "out", x.size(), "x");
  const auto device = flag.device();
  check_flag(op, flag, "found_inf", device);
  check_list(op, x, "x", device);
  check_list_like(op, y, "y", x, device);
  check_list_like(op, out, "out", x, device);
  for (size_t i = 0; i < x.size(); ++i) {
    TORCH_CHECK(x[i].scalar_type() == y[i].scalar_type(), op, ": `y[", i, "]` has dtype ", y[i].scalar_type(),
                " but `x[", i, "]` has ", x[i].scalar_type(), "; x and y must share a dtype");
  }
  check_writable(op, out, "out", x, "x");
  check_writable(op, out, "out", y, "y");
  std::vector<Operand> operands;
  operands.reserve(3 * x.size() + 1);
  add_written(operands, out, "out");
  add_read(operands, x, "x", out);
  add_read(operands, y, "y", out);
  add_flag(operands, flag, "found_inf");
  check_separate(op, operands);
}

// Returns the stash as contiguous tensors, undefined where nothing is stashed.
inline std::vector<at::Tensor> check_combine_args(const char* op, at::TensorList fresh,
                                                  const c10::List<std::optional<at::Tensor>>& stash,
                                                  at::TensorList out, const at::Tensor& flag) {
  check_same_length(op, out, "out", fresh.size(), "new");
  const bool has_stash = !stash.empty();
  TORCH_CHECK(!has_stash || stash.size() == fresh.size(), op, ": `stash` has ", stash.size(),
              " entries but `new` has ", fresh.size(), "; pass one per tensor (None where nothing is stashed)");
  const auto device = flag.device();
  check_flag(op, flag, "found_inf", device);
  check_list(op, fresh, "new", device);
  check_list_like(op, out, "out", fresh, device);
  check_writable(op, out, "out", fresh, "new");
  std::vector<at::Tensor> stashed(fresh.size());
  std::vector<at::Tensor> given(fresh.size());  // undefined where nothing is stashed
  for (size_t i = 0; has_stash && i < fresh.size(); ++i) {
    const std::optional<at::Tensor> entry = stash[i];
    if (!entry.has_value() || !entry->defined()) continue;
    check_tensor(op, *entry, "stash", i, device, fresh[i].numel());
    TORCH_CHECK(entry->scalar_type() == out[i].scalar_type(), op, ": `stash[", i, "]` has dtype ",
                entry->scalar_type(), " but `out[", i, "]` has ", out[i].scalar_type(), "; they must match");
    check_writable(op, out[i], "out", i, *entry, "stash");
    given[i] = *entry;
    stashed[i] = entry->contiguous();
  }
  std::vector<Operand> operands;
  operands.reserve(3 * fresh.size() + 1);
  add_written(operands, out, "out");
  add_read(operands, fresh, "new", out);
  add_read(operands, given, "stash", out);
  add_flag(operands, flag, "found_inf");
  check_separate(op, operands);
  return stashed;
}

inline void check_unscale_l2norm_args(const char* op, at::TensorList inputs, at::TensorList outputs,
                                      const at::Tensor& flag) {
  if (!outputs.empty()) check_same_length(op, outputs, "out", inputs.size(), "inputs");
  const auto device = flag.device();
  check_flag(op, flag, "found_inf", device);
  check_list(op, inputs, "inputs", device);
  check_list_like(op, outputs, "out", inputs, device);
  check_writable(op, outputs, "out", inputs, "inputs");
  std::vector<Operand> operands;
  operands.reserve(2 * inputs.size() + 1);
  add_written(operands, outputs, "out");
  add_read(operands, inputs, "inputs", outputs);
  add_flag(operands, flag, "found_inf");
  check_separate(op, operands);
}

// Norm results are float32, or float64 when an input is float64.
inline at::ScalarType norm_dtype(at::TensorList inputs) {
  for (const auto& t : inputs) {
    if (t.scalar_type() == at::kDouble) return at::kDouble;
  }
  return at::kFloat;
}

}  // namespace ampkit
