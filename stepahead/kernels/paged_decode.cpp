// Attention over the paged KV cache on CPU, one query per row: a generated token's, or a prompt
// token's at its own position (the CPU path attends every token of a step this way, so a prompt's
// attention never depends on how it was chunked). Each row's keys are read through its block table
// where they lie, with no gather into a scratch buffer, no padding and no mask.
//
// The cache is head-major, [kv_heads, blocks, block_size, head_dim] (attention/paged_cache.py), of
// float32, bfloat16 or float16 values; 16-bit ones widen to float32 exactly, so the arithmetic is
// float32's either way and a 16-bit cache only halves the bytes a step reads.
// Query head h attends with KV head h / (heads / kv_heads), as grouped-query checkpoints expect. Each
// (row, KV head), or (tile of a prompt's rows, KV head), is one task (PagedDecode::run). Nothing in a
// row's arithmetic depends on the other rows or the thread that runs it, so a token's attention is
// bitwise the same in any batch.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ops.h"
#include "paged_decode.h"
#include "paged_decode_loops.h"
#include "simd.h"
#include "team.h"

namespace stepahead_cpu {

namespace {

// Multiply-adds a thread should have before a parallel region pays for waking it.
constexpr int64_t kWorkPerTask = 1 << 16;

// The loops' AVX2 vectors (paged_decode_loops.h): eight floats.
struct AvxLanes8 {
  using Vec = __m256;
  static constexpr int kLanes = 8;
  // 4 keys x 3 heads of score sums, or 4 x 3 of output sums, fill 12 of the 16 registers
  static constexpr int kHeadsTogether = 3;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static Vec loadf(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load(const c10::BFloat16* p) {  // the upper half of a float's bits
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static Vec load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static Vec exp(Vec x) { return exp8(x); }
  static __m256 fold8(Vec v) { return v; }
  static float sum_lanes(Vec v) { return stepahead_cpu::sum_lanes(v); }
  static float max_lanes(Vec v) { return stepahead_cpu::max_lanes(v); }
};

}  // namespace

// q [rows, heads, head_dim] (any row and head strides, unit stride within a head), block_table
// [rows, width] int64, seq_lens [rows] int64 (keys per row, its new token included, already in the
// cache), out [rows, heads, head_dim] contiguous.
PagedDecode::PagedDecode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, at::Tensor& out,
                         int64_t window, double softcap) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none), got ", softcap);
  window_ = window, softcap_ = static_cast<float>(softcap);
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1,
              "q must be a float32 [rows, heads, head_dim] tensor with unit stride in head_dim");
  cache_type_ = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 &&
                  (cache_type_ == at::kFloat || cache_type_ == at::kBFloat16 || cache_type_ == at::kHalf) &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == cache_type_ && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous [kv_heads, blocks, block_size, head_dim] tensors, both "
              "float32, both bfloat16 or both float16");
  rows_ = q.size(0), heads_ = q.size(1), head_dim_ = q.size(2), kv_heads_ = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == head_dim_ && heads_ % kv_heads_ == 0,
              "q's heads must be a multiple of the cache's KV heads");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == rows_ && block_table.scalar_type() == at::kLong &&
                  block_table.stride(1) == 1,
              "block_table must be an int64 [rows, width] tensor with unit column stride");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == rows_ && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int64 [rows] tensor");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "out must be a contiguous float32 tensor shaped like q");
  // AVX-512's loops span 64 outputs of a head at a time; other heads keep AVX2's everywhere
  wide_ = head_dim_ % 64 == 0 && attention_uses_avx512();
  q_ = q.data_ptr<float>(), k_ = k_cache.data_ptr(), v_ = v_cache.data_ptr();
  tables_ = block_table.data_ptr<int64_t>(), lens_ = seq_lens.data_ptr<int64_t>(), out_ = out.data_ptr<float>();
  blocks_ = k_cache.size(1), block_size_ = k_cache.size(2);
  q_row_stride_ = q.stride(0), q_head_stride_ = q.stride(1), table_stride_ = block_table.stride(0);
  scale_ = static_cast<float>(scale);
  const int64_t width = block_table.size(1);
  int64_t keys = 0;
  for (int64_t r = 0; r < rows_; ++r) {
    TORCH_CHECK(lens_[r] >= 1 && lens_[r] <= width * block_size_, "row ", r, " has ", lens_[r],
                " keys, its block table covers ", width * block_size_);
    keys += lens_[r] - first_key(r);
  }
  // Tiles: runs of rows that read the same keys (a prompt's tokens). A row joins the tile of the row
  // before it where its length is no shorter and its table names the same blocks for every key that
  // row reads; by induction it then reads every earlier row's keys where they do, and the tile's last
  // row reads them all. The tiled loops need whole 8-token groups and 32-float output spans.
  const bool tiles = head_dim_ % 32 == 0 && block_size_ % 8 == 0 && kValueSpan % block_size_ == 0;
  const auto joins_tile_before = [&](int64_t r) {
    const int64_t* before = tables_ + (r - 1) * table_stride_;
    return r - tile_starts_.back() < kTileRows && lens_[r] >= lens_[r - 1] &&
           std::equal(before, before + (lens_[r - 1] + block_size_ - 1) / block_size_, tables_ + r * table_stride_);
  };
  for (int64_t r = 0; r < rows_; ++r)
    if (!tiles || r == 0 || !joins_tile_before(r)) tile_starts_.push_back(r);
  const int64_t num_tiles = static_cast<int64_t>(tile_starts_.size());
  tile_starts_.push_back(rows_);
  work_per_task_ = std::max<int64_t>(1, keys / std::max<int64_t>(num_tiles, 1) * (heads_ / kv_heads_) * head_dim_ * 2);
}

// The scores of the task's query heads against the row's keys, a softmax (its sum eight lanes at a
// time), then the weighted sums of the values in token order. The heads that share a KV head are one
// task, so each key and value comes from memory once (and from L1 for the group's other heads).
//
// Where blocks hold a multiple of eight tokens (the usual 16) and heads a multiple of eight floats,
// scores come eight tokens at a time: independent multiply-add chains, then one transposing sum
// (sum_lanes8), where a score at a time waited on its own chain and its own horizontal sum (the step's
// attention took a tenth of a 32-row decode step). Up to three heads of the group go together (four
// on AVX-512), so a 16-bit key or value is widened once for them (vcvtph2ps costs more than the
// multiply-adds it feeds, and widening once per head made a 16-bit cache no faster to read than a
// float32 one), and the weighted sums hold 32 outputs of each (64 on AVX-512) in registers across the
// tokens. Where the process has AVX-512 (attention_uses_avx512) and heads are a multiple of 64 floats,
// the same loops run on 16-float vectors (paged_decode_avx512.cpp): half the multiply-adds, widenings
// and exponentials. Their sums are split into lanes differently, so their bits differ from AVX2's
// within float rounding; a process uses one or the other for every row. The loops go block by block
// (a token's block and place by division cost as much as its scores). A row's blocks lie scattered
// and each is a page of its own, where the hardware prefetchers stop, so the keys two blocks ahead
// are asked for, and each block's values while its keys are scored (the gains: docs/BENCHMARKS.md,
// section 14.4). Each
// output's sums run in the same order as one head and key at a time, and a
// row's arithmetic is fixed by the row alone.
void PagedDecode::run(int64_t task, std::vector<float>& scratch) const {
  if (wide_) return run_wide(task, scratch);
  switch (cache_type_) {
    case at::kBFloat16: return run_as<c10::BFloat16, AvxLanes8>(task, scratch);
    case at::kHalf: return run_as<c10::Half, AvxLanes8>(task, scratch);
    default: return run_as<float, AvxLanes8>(task, scratch);
  }
}

void PagedDecode::warm(int64_t task, Warmer& warmer) const {
  // a tile's last row reads every key its other rows read
  const int64_t row = tile_starts_[task / kv_heads_ + 1] - 1, kv_head = task % kv_heads_, len = lens_[row];
  const int64_t* table = tables_ + row * table_stride_;
  const int64_t bytes = head_dim_ * static_cast<int64_t>(at::elementSize(cache_type_));
  // from the block of the tile's first row's first key (its windows start no later than the others')
  const int64_t from = first_key(tile_starts_[task / kv_heads_]) / block_size_ * block_size_;
  for (int64_t start = from; start < len; start += block_size_) {
    const int64_t at = (kv_head * blocks_ + table[start / block_size_]) * block_size_ * bytes;
    const int64_t n = std::min(block_size_, len - start) * bytes;
    warmer.add(static_cast<const char*>(k_) + at, n);
    warmer.add(static_cast<const char*>(v_) + at, n);
  }
}

void PagedDecode::cap_scores(float* scores, int64_t from, int64_t len) const {
  if (softcap_ == 0) return;
  for (int64_t t = from; t < len; ++t) scores[t] = std::tanh(scores[t] / softcap_) * softcap_;
}

std::string paged_decode_isa() { return attention_uses_avx512() ? "avx512" : "avx2"; }

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, at::Tensor& out,
                            int64_t window, double softcap) {
  const PagedDecode job(q, k_cache, v_cache, block_table, seq_lens, scale, out, window, softcap);
  // Tasks go to whichever thread asks first: a prompt's later rows read more keys than its first
  // (a 2,048-token prompt's second half holds three quarters of its work), which a static split
  // into one range per thread left to one thread.
  const int64_t chunk = std::max<int64_t>(1, kWorkPerTask / job.work_per_task());
  const int threads = job.tasks() * job.work_per_task() < kWorkPerTask ? 1 : at::get_num_threads();
  run_in_team(threads, [&](Team::Member& me) {
    std::vector<float> scratch;
    me.share(job.tasks(), chunk, [&](int64_t task) { job.run(task, scratch); });
  });
}

}  // namespace stepahead_cpu
