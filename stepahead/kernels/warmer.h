// Warmer: cache lines a thread asks for a few at a time between pieces of its other work.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace stepahead_cpu {

// A decode step's attention reads each layer's keys and values from memory (3-5 MB per layer at 32
// rows of the built-in model, too many for the caches to keep across 30 layers) and waits on them,
// while the projections before it compute and leave the memory idle. So during a layer's projections
// each thread asks for its share of the next attention's cache lines, `step` by `step` between
// tiles, and the attention finds them in cache. The projections pay part of what the attention
// saves; the net gain is in docs/BENCHMARKS.md, section 14.4 ("Warming the next layer's attention").
class Warmer {
 public:
  // Forgets what was not asked for yet.
  void clear() {
    ranges_.clear();
    next_ = 0;
  }

  // bytes from p, to be asked for after the ranges added before.
  void add(const void* p, int64_t bytes) {
    const char* first = static_cast<const char*>(p);
    ranges_.emplace_back(first, first + bytes);
  }

  // Asks for the next `lines` cache lines (fewer where the ranges end).
  void step(int lines) {
    while (lines > 0 && next_ < ranges_.size()) {
      auto& [at, end] = ranges_[next_];
      for (; lines > 0 && at < end; --lines, at += 64) _mm_prefetch(at, _MM_HINT_T0);
      if (at >= end) ++next_;
    }
  }

 private:
  std::vector<std::pair<const char*, const char*>> ranges_;
  size_t next_ = 0;
};

}  // namespace stepahead_cpu
