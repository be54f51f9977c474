// Decode attention's tasks (paged_decode.cpp), for callers that hand them out themselves (DecodeStack).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "warmer.h"

namespace stepahead_cpu {

// Whether this process attends on AVX-512's 16-float vectors: the CPU (and its OS) has AVX-512 F, BW,
// VL and DQ, and STEPAHEAD_MAX_CPU_ISA says neither avx2 nor avx512_vnni (256-bit vectors). Decided once: it cannot change while a
// process runs, so every row of every step takes the same path (paged_decode_avx512.cpp).
bool attention_uses_avx512();

// One step's attention over the paged cache, a query per row (a generated token's, or a prompt's):
// tiles x KV heads tasks, each independent. A tile is one row, or consecutive rows that read the same
// keys (a prompt's tokens), computed together with each row's bits unchanged.
class PagedDecode {
 public:
  // Checks the operands as paged_decode_attention takes them (ops.h); they must outlive the object.
  // window: each row attends to its last `window` keys only (0: to all of them); softcap: scores
  // become softcap * tanh(score / softcap) (0: as they are).
  PagedDecode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, at::Tensor& out,
              int64_t window = 0, double softcap = 0);

  int64_t tasks() const { return (static_cast<int64_t>(tile_starts_.size()) - 1) * kv_heads_; }
  // Multiply-adds of an average task.
  int64_t work_per_task() const { return work_per_task_; }

  // Task `task`: the query heads of one tile's rows that share one KV head. scratch: the caller's
  // buffer, grown as needed.
  void run(int64_t task, std::vector<float>& scratch) const;

  // Adds the memory task `task` reads (its rows' keys and values for its KV head) to warmer.
  void warm(int64_t task, Warmer& warmer) const;

 private:
  // run() over caches of element type T (float, c10::BFloat16 or c10::Half) on vectors V
  // (paged_decode_loops.h)
  template <typename T, class V>
  void run_as(int64_t task, std::vector<float>& scratch) const;
  template <typename T, class V>
  void run_row(int64_t row, int64_t kv_head, std::vector<float>& scratch) const;
  template <typename T, class V>
  void run_tile(int64_t first, int64_t end, int64_t kv_head, std::vector<float>& scratch) const;
  // run() on AVX-512's vectors (paged_decode_avx512.cpp)
  void run_wide(int64_t task, std::vector<float>& scratch) const;
  // The row's first key inside its window (0 without one).
  int64_t first_key(int64_t row) const { return window_ > 0 ? std::max<int64_t>(0, lens_[row] - window_) : 0; }
  // Scores [from, len) of one head's row capped by softcap_ (when set).
  void cap_scores(float* scores, int64_t from, int64_t len) const;

  const float* q_;
  const void* k_;
  const void* v_;
  at::ScalarType cache_type_;
  const int64_t* tables_;
  const int64_t* lens_;
  float* out_;
  int64_t rows_, heads_, kv_heads_, head_dim_, blocks_, block_size_;
  int64_t q_row_stride_, q_head_stride_, table_stride_, work_per_task_;
  float scale_;
  int64_t window_;
  float softcap_;
  bool wide_;  // on AVX-512's 16-float vectors
  std::vector<int64_t> tile_starts_;  // each tile's first row, then rows_
};

}  // namespace stepahead_cpu
