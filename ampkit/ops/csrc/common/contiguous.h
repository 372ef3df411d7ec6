// Contiguous views for multi-tensor kernels (any device): inputs are copied only when strided, and
// strided outputs are written through scratch buffers copied back at the end.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <vector>

namespace ampkit {

// Contiguous versions of read-only inputs (a copy only for the non-contiguous ones).
inline std::vector<at::Tensor> contiguous_inputs(at::TensorList list) {
  std::vector<at::Tensor> out;
  out.reserve(list.size());
  for (const auto& t : list) out.push_back(t.contiguous());
  return out;
}

// Outputs are written through contiguous buffers: a non-contiguous output gets a scratch tensor that
// finish() copies back, so every op gives the correct result on strided views, at the cost of a copy.
class OutputBuffers {
 public:
  explicit OutputBuffers(at::TensorList outputs) : targets_(outputs) {
    work_.reserve(outputs.size());
    for (const auto& t : outputs) work_.push_back(t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous));
  }
  const std::vector<at::Tensor>& tensors() const { return work_; }
  void finish() {
    for (size_t i = 0; i < work_.size(); ++i) {
      if (!work_[i].is_same(targets_[i])) targets_[i].copy_(work_[i]);
    }
  }

 private:
  at::TensorList targets_;
  std::vector<at::Tensor> work_;
};

}  // namespace ampkit
