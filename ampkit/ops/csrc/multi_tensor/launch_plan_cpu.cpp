// The CUDA launchers' host-side decisions exposed to the CPU build, so CPU tests check the code a GPU runs:
// chunk_plan (common/chunk_plan.h: which tensors and chunks each launch carries, which tensors go vectorized)
// and cuda_kernels (common/kernel_choice.h: which kernels AMPKIT_CUDA_KERNELS selects).
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "common/chunk_plan.h"
#include "common/kernel_choice.h"
#include "multi_tensor/multi_tensor_cpu.h"

namespace ampkit {

std::tuple<at::Tensor, at::Tensor> chunk_plan_cpu(c10::IntArrayRef numels, c10::IntArrayRef addresses,
                                                  c10::IntArrayRef element_bytes) {
  const auto depth = static_cast<int64_t>(element_bytes.size());
  TORCH_CHECK(depth >= 1 && depth <= cuda::kMaxDepth, "ampkit_multi_tensor.chunk_plan: element_bytes has ", depth,
              " entries; expected 1 to ", cuda::kMaxDepth, " (one per pointer slot)");
  const auto count = static_cast<int64_t>(numels.size());
  TORCH_CHECK(static_cast<int64_t>(addresses.size()) == count * depth, "ampkit_multi_tensor.chunk_plan: addresses has ",
              addresses.size(), " entries; expected len(numels) * len(element_bytes) = ", count * depth);
  std::vector<int> bytes(element_bytes.begin(), element_bytes.end());
  std::vector<cuda::TensorSlots> tensors(count);
  for (int64_t t = 0; t < count; ++t) {
    TORCH_CHECK(numels[t] >= 0, "ampkit_multi_tensor.chunk_plan: numels[", t, "] is ", numels[t], "; expected >= 0");
    tensors[t] = {{}, numels[t], t};
    for (int64_t d = 0; d < depth; ++d) {
      tensors[t].ptr[d] = reinterpret_cast<void*>(static_cast<std::uintptr_t>(addresses[t * depth + d]));
    }
  }
  std::vector<int64_t> tensor_rows;
  std::vector<int64_t> block_rows;
  const auto launches = cuda::plan_chunks(tensors.data(), count, static_cast<int>(depth), bytes.data());
  for (size_t l = 0; l < launches.size(); ++l) {
    for (const auto& t : launches[l].tensors) tensor_rows.insert(tensor_rows.end(), {int64_t(l), t.source, t.vectorized});
    for (const auto& b : launches[l].blocks) block_rows.insert(block_rows.end(), {int64_t(l), b.tensor, b.chunk});
  }
  const auto as_table = [](const std::vector<int64_t>& rows) {
    return at::tensor(rows, at::kLong).reshape({static_cast<int64_t>(rows.size() / 3), 3});
  };
  return {as_table(tensor_rows), as_table(block_rows)};
}

std::string cuda_kernels_cpu() { return cuda_kernels_name(cuda_kernels()); }

}  // namespace ampkit
