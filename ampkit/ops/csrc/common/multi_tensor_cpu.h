// CPU multi-tensor driver: a list of tensors is treated as one flat array, cut into equal chunks
// that at::parallel_for spreads over the threads. Small tensors share a chunk (1M params in 52
// tensors is 32 chunks, not 52 tasks) and big ones span many, so threads get equal work whatever
// the size mix. A chunk is a run of segments, each a slice of one tensor; per-segment results
// (norm partial sums) are reduced in a fixed order, so results do not depend on the thread count.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include "common/contiguous.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace ampkit {
namespace cpu {

constexpr int64_t kChunkElements = 32768;
// A thread gets at least this many chunks: below ~64K elements an OpenMP region costs more than it saves.
constexpr int64_t kMinChunksPerThread = 2;

struct Segment {
  int64_t tensor;  // index into the tensor list
  int64_t begin;   // first element of the slice
  int64_t length;  // number of elements
};

class ChunkPlan {
 public:
  explicit ChunkPlan(at::TensorList tensors, int64_t chunk_elements = kChunkElements) {
    chunk_starts_.push_back(0);
    int64_t filled = 0;
    for (size_t t = 0; t < tensors.size(); ++t) {
      const int64_t n = tensors[t].numel();
      for (int64_t offset = 0; offset < n;) {
        const int64_t take = std::min(n - offset, chunk_elements - filled);
        segments_.push_back({static_cast<int64_t>(t), offset, take});
        offset += take;
        filled += take;
        if (filled == chunk_elements) {
          chunk_starts_.push_back(static_cast<int64_t>(segments_.size()));
          filled = 0;
        }
      }
    }
    if (filled > 0) chunk_starts_.push_back(static_cast<int64_t>(segments_.size()));
  }

  int64_t num_chunks() const { return static_cast<int64_t>(chunk_starts_.size()) - 1; }
  const std::vector<Segment>& segments() const { return segments_; }

  // Calls f(segment_index, segment) for every segment; chunks run in parallel.
  template <typename F>
  void parallel_for_each(const F& f) const {
    at::parallel_for(0, num_chunks(), kMinChunksPerThread, [&](int64_t chunk_begin, int64_t chunk_end) {
      for (int64_t s = chunk_starts_[chunk_begin]; s < chunk_starts_[chunk_end]; ++s) f(s, segments_[s]);
    });
  }

 private:
  std::vector<Segment> segments_;
  std::vector<int64_t> chunk_starts_;
};

// Collects "a non-finite value was seen" from all threads and raises the flag tensor once.
class NonFiniteFlag {
 public:
  void note(bool seen) {
    if (seen) seen_.store(true, std::memory_order_relaxed);
  }
  void publish(const at::Tensor& flag) const {
    if (seen_.load(std::memory_order_relaxed)) flag.fill_(1);
  }

 private:
  std::atomic<bool> seen_{false};
};

}  // namespace cpu
}  // namespace ampkit
