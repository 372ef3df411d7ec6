// The host side of the CUDA multi-tensor launches, in plain C++ (no CUDA, no ATen) so the CPU build runs the
// very code the CUDA launcher does (torch.ops.ampkit_multi_tensor.chunk_plan, tested on CPU). A list of tensors
// is cut into chunks of kChunkElements; one CUDA block takes one chunk. A launch carries the addresses of up to
// max_tensors_for_depth(depth) tensors and up to kMaxBlocks chunks in the kernel's parameter block (< 4 KB),
// so a list of thousands of small tensors costs a few launches, not one each; a tensor with more chunks than a
// launch holds continues in the next one. Each tensor of a launch is marked vectorizable when every address it
// has is aligned to kVectorElements elements of its slot's type: its chunks (which start at multiples of
// kChunkElements) then load and store kVectorElements at a time, 128 bits for float32, with a scalar tail.
#pragma once

#include <cstdint>
#include <vector>

namespace ampkit {
namespace cuda {

constexpr int kMaxDepth = 6;                // pointer slots per tensor (param, grad, states, master)
constexpr int kMaxBlocks = 320;             // chunks per launch
constexpr int64_t kChunkElements = 65536;   // elements per chunk (a multiple of kVectorElements)
constexpr int kVectorElements = 4;          // elements per vector load: 16 bytes of float32

// Tensors per launch for `depth` pointer slots, sized so the metadata stays under 3.6 KB.
constexpr int max_tensors_for_depth(int depth) {
  return depth == 1 ? 90 : depth == 2 ? 64 : depth == 3 ? 48 : depth == 4 ? 36 : depth == 5 ? 32 : 28;
}

// One tensor of the list as a launch sees it: up to kMaxDepth addresses (nullptr where a slot is absent),
// its element count and its index in the caller's list (where per-tensor results and values live).
struct TensorSlots {
  void* ptr[kMaxDepth];
  int64_t numel;
  int64_t index;
};

// A tensor's place in one launch.
struct PlannedTensor {
  int64_t source;   // position in the list given to plan_chunks
  bool vectorized;  // every address is aligned to kVectorElements elements of its slot
};

// A block of one launch: which of the launch's tensors (0-based within the launch) and which chunk of it.
struct PlannedBlock {
  int tensor;
  int64_t chunk;
};

struct PlannedLaunch {
  std::vector<PlannedTensor> tensors;
  std::vector<PlannedBlock> blocks;
};

inline bool aligned_for_vectors(const TensorSlots& t, int depth, const int* element_bytes) {
  for (int d = 0; d < depth; ++d) {
    const auto address = reinterpret_cast<std::uintptr_t>(t.ptr[d]);
    if (address % (static_cast<std::uintptr_t>(kVectorElements) * element_bytes[d]) != 0) return false;
  }
  return true;
}

// The launches that cover `count` tensors of `depth` slots whose element sizes are `element_bytes[d]`.
// Empty tensors are left out; an empty list gives no launch.
inline std::vector<PlannedLaunch> plan_chunks(const TensorSlots* tensors, int64_t count, int depth,
                                              const int* element_bytes) {
  const int max_tensors = max_tensors_for_depth(depth);
  std::vector<PlannedLaunch> launches;
  PlannedLaunch current;
  for (int64_t t = 0; t < count; ++t) {
    const int64_t numel = tensors[t].numel;
    if (numel == 0) continue;
    if (static_cast<int>(current.tensors.size()) == max_tensors ||
        static_cast<int>(current.blocks.size()) == kMaxBlocks) {
      launches.push_back(std::move(current));
      current = {};
    }
    current.tensors.push_back({t, aligned_for_vectors(tensors[t], depth, element_bytes)});
    const int64_t chunks = (numel + kChunkElements - 1) / kChunkElements;
    for (int64_t c = 0; c < chunks; ++c) {
      if (static_cast<int>(current.blocks.size()) == kMaxBlocks) {  // the tensor continues in the next launch
        const PlannedTensor continued = current.tensors.back();
        launches.push_back(std::move(current));
        current = {};
        current.tensors.push_back(continued);
      }
      current.blocks.push_back({static_cast<int>(current.tensors.size()) - 1, c});
    }
  }
  if (!current.blocks.empty()) launches.push_back(std::move(current));
  return launches;
}

}  // namespace cuda
}  // namespace ampkit
