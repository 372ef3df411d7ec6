// Argument checks for multi-tensor ops: every message names the op, the argument and the index.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ampkit {

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

// `list` must have as many tensors as `ref` (named `ref_name`).
inline void check_same_length(const char* op, at::TensorList list, const char* name, int64_t ref_len,
                              const char* ref_name) {
  TORCH_CHECK(static_cast<int64_t>(list.size()) == ref_len, op, ": `", name, "` has ", list.size(),
              " tensors but `", ref_name, "` has ", ref_len, "; the lists must have the same length");
}

// Element i of `list` is a float32/float16/bfloat16/float64 tensor on `device` with `numel` elements.
inline void check_tensor(const char* op, const at::Tensor& t, const char* name, size_t i,
                         const at::Device& device, std::optional<int64_t> numel) {
  TORCH_CHECK(t.defined(), op, ": `", name, "[", i, "]` is undefined (None)");
  TORCH_CHECK(is_supported_float(t.scalar_type()), op, ": `", name, "[", i, "]` has dtype ",
              t.scalar_type(), "; expected float32, float16, bfloat16 or float64");
  TORCH_CHECK(t.device() == device, op, ": `", name, "[", i, "]` is on ", t.device(),
              " but the op runs on ", device, "; all tensors must be on one device");
  if (numel.has_value()) {
    TORCH_CHECK(t.numel() == *numel, op, ": `", name, "[", i, "]` has ", t.numel(),
                " elements but the matching input has ", *numel);
  }
}

inline void check_list(const char* op, at::TensorList list, const char* name, const at::Device& device) {
  for (size_t i = 0; i < list.size(); ++i) check_tensor(op, list[i], name, i, device, std::nullopt);
}

// `list[i]` matches `ref[i]` in size (same length already checked).
inline void check_list_like(const char* op, at::TensorList list, const char* name, at::TensorList ref,
                            const at::Device& device) {
  for (size_t i = 0; i < list.size(); ++i) check_tensor(op, list[i], name, i, device, ref[i].numel());
}

// `out` (named `name`) is written while the matching tensor of `read` (named `read_name`) is read, in parallel
// chunks: it may be that tensor itself (in place) but may not share only part of its memory, nor hold one
// element twice (an expanded tensor), or the result would depend on the order of the chunks.
inline void check_writable(const char* op, const at::Tensor& out, const char* name, size_t i,
                           const at::Tensor& read, const char* read_name) {
  TORCH_CHECK(at::has_internal_overlap(out) != at::MemOverlap::Yes, op, ": `", name, "[", i,
              "]` holds one element at several positions (an expanded tensor?); pass one that owns its memory, "
              "e.g. its clone()");
  TORCH_CHECK(at::get_overlap_status(out, read) != at::MemOverlapStatus::Partial, op, ": `", name, "[", i,
              "]` shares part of its memory with `", read_name, "[", i,
              "]`; pass the same tensor (in place) or separate ones");
}

inline void check_writable(const char* op, at::TensorList out, const char* name, at::TensorList read,
                           const char* read_name) {
  for (size_t i = 0; i < out.size(); ++i) check_writable(op, out[i], name, i, read[i], read_name);
}

// One tensor of a multi-tensor call as check_separate sees it: its list's name, its index there (kNoIndex for a
// tensor of no list, the overflow flag), and whether the op writes it.
constexpr size_t kNoIndex = static_cast<size_t>(-1);

struct Operand {
  const at::Tensor* tensor;
  const char* name;
  size_t index;
  bool written;
};

inline std::string operand_name(const Operand& o) {
  return o.index == kNoIndex ? std::string(o.name) : std::string(o.name) + "[" + std::to_string(o.index) + "]";
}

// The overflow flag is written by every chunk that sees an inf: it may share memory with no tensor of the call.
inline void add_flag(std::vector<Operand>& operands, const at::Tensor& flag, const char* name) {
  operands.push_back({&flag, name, kNoIndex, true});
}

inline void add_written(std::vector<Operand>& operands, at::TensorList out, const char* name) {
  for (size_t i = 0; i < out.size(); ++i) operands.push_back({&out[i], name, i, true});
}

// A read tensor that is the very tensor written at its index (in place) adds nothing to check: it is left out, so
// an in-place call sorts half as many spans.
inline void add_read(std::vector<Operand>& operands, at::TensorList read, const char* name, at::TensorList out) {
  for (size_t i = 0; i < read.size(); ++i) {
    if (i < out.size() && read[i].is_same(out[i])) continue;
    operands.push_back({&read[i], name, i, false});
  }
}

// No tensor the op writes may share memory with a tensor of another index, read or written: the kernels run every
// index's chunks in parallel, so `out[0]` over `inputs[1]` (or one tensor listed twice as an output) gave a result
// that depended on their order. Sorted by address, so a call costs O(n log n), not a check of every pair. Tensors
// that are not one gap-free block are left out, as at::get_overlap_status leaves them.
inline void check_separate(const char* op, const std::vector<Operand>& operands) {
  struct Span {
    uintptr_t begin, end;
    const Operand* operand;
  };
  std::vector<Span> spans;
  spans.reserve(operands.size());
  bool any_written = false;
  for (const Operand& o : operands) {
    const at::Tensor& t = *o.tensor;
    if (!t.defined() || t.numel() == 0 || !t.is_non_overlapping_and_dense()) continue;
    const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
    spans.push_back({begin, begin + static_cast<uintptr_t>(t.numel() * t.element_size()), &o});
    any_written = any_written || o.written;
  }
  if (!any_written) return;
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  std::vector<const Span*> open;  // spans begun before this one that have not ended
  for (const Span& span : spans) {
    open.erase(std::remove_if(open.begin(), open.end(), [&](const Span* s) { return s->end <= span.begin; }),
               open.end());
    for (const Span* earlier : open) {
      const Operand& a = *earlier->operand;
      const Operand& b = *span.operand;
      if (a.index == b.index || !(a.written || b.written)) continue;
      const Operand& w = a.written && b.index != kNoIndex ? a : b;  // the flag named first, as it is the odd one
      const Operand& r = &w == &a ? b : a;
      TORCH_CHECK(w.index != kNoIndex, op, ": `", w.name, "` shares memory with `", operand_name(r),
                  "`; pass a flag tensor of its own, e.g. torch.zeros(1)");
      TORCH_CHECK(false, op, ": `", operand_name(w), "` shares memory with `", operand_name(r),
                  "`; an output may be its own index's input (in place), never another index's tensor");
    }
    open.push_back(&span);
  }
}

// The overflow flag: one float32 or int32 element on the op's device, set to 1 on a non-finite value.
inline void check_flag(const char* op, const at::Tensor& flag, const char* name, const at::Device& device) {
  TORCH_CHECK(flag.numel() == 1, op, ": `", name, "` must have exactly one element, got ", flag.numel());
  TORCH_CHECK(flag.scalar_type() == at::kFloat || flag.scalar_type() == at::kInt, op, ": `", name,
              "` has dtype ", flag.scalar_type(), "; expected float32 or int32");
  TORCH_CHECK(flag.device() == device, op, ": `", name, "` is on ", flag.device(), " but the tensors are on ",
              device);
}

}  // namespace ampkit
