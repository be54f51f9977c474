// Decode attention over the paged KV cache on CPU: one new token per row, its keys read through the
// row's block table where they lie, with no gather into a scratch buffer, no padding and no mask.
//
// The cache is head-major, [kv_heads, blocks, block_size, head_dim] float32 (attention/paged_cache.py).
// Query head h attends with KV head h / (heads / kv_heads), as grouped-query checkpoints expect. Each
// (row, KV head) is one task (PagedDecode::run). Nothing in a row's arithmetic depends on the
// other rows or the thread that runs it, so a token's attention is bitwise the same in any batch.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "paged_decode.h"
#include "simd.h"

namespace stepahead_cpu {

namespace {

// Multiply-adds a thread should have before a parallel region pays for waking it.
constexpr int64_t kWorkPerTask = 1 << 16;

// out += p * v over head_dim floats.
inline void axpy(float p, const float* v, float* out, int64_t n) {
  const __m256 pp = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
  for (; i < n; ++i) out[i] = std::fma(p, v[i], out[i]);
}

// Asks for the cache lines of n floats from p.
inline void prefetch(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

}  // namespace

// q [rows, heads, head_dim] (any row and head strides, unit stride within a head), block_table
// [rows, width] int64, seq_lens [rows] int64 (keys per row, its new token included, already in the
// cache), out [rows, heads, head_dim] contiguous.
PagedDecode::PagedDecode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1,
              "q must be a float32 [rows, heads, head_dim] tensor with unit stride in head_dim");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous float32 [kv_heads, blocks, block_size, head_dim] tensors");
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
  q_ = q.data_ptr<float>(), k_ = k_cache.data_ptr<float>(), v_ = v_cache.data_ptr<float>();
  tables_ = block_table.data_ptr<int64_t>(), lens_ = seq_lens.data_ptr<int64_t>(), out_ = out.data_ptr<float>();
  blocks_ = k_cache.size(1), block_size_ = k_cache.size(2);
  q_row_stride_ = q.stride(0), q_head_stride_ = q.stride(1), table_stride_ = block_table.stride(0);
  scale_ = static_cast<float>(scale);
  const int64_t width = block_table.size(1);
  int64_t keys = 0;
  for (int64_t r = 0; r < rows_; ++r) {
    TORCH_CHECK(lens_[r] >= 1 && lens_[r] <= width * block_size_, "row ", r, " has ", lens_[r],
                " keys, its block table covers ", width * block_size_);
    keys += lens_[r];
  }
  work_per_task_ = std::max<int64_t>(1, keys / std::max<int64_t>(rows_, 1) * (heads_ / kv_heads_) * head_dim_ * 2);
}

// The scores of the task's query heads against the row's keys, a softmax (its sum eight lanes at a
// time), then the weighted sums of the values in token order. The heads that share a KV head are one
// task, so each key and value comes from memory once (and from L1 for the group's other heads).
//
// Where blocks hold a multiple of eight tokens (the usual 16) and heads a multiple of eight floats,
// scores come eight tokens at a time: eight independent multiply-add chains, then one transposing
// sum (sum_lanes8), where a score at a time waited on its own chain and its own horizontal sum (the
// step's attention took a tenth of a 32-row decode step). The weighted sums keep up to 64 of a head's
// outputs in registers across the tokens. A row's blocks lie scattered and each is a page of its own,
// where the hardware prefetchers stop, so the keys two blocks ahead and the next block's values are
// asked for. 32 rows of the built-in model's shapes, 30 layers' caches (cold, as in a step), 2
// threads: 531-642 against 407-446 us per layer. Either way a row's arithmetic is fixed by the row
// alone.
void PagedDecode::run(int64_t task, std::vector<float>& scratch) const {
  const int64_t row = task / kv_heads_, kv_head = task % kv_heads_, group = heads_ / kv_heads_;
  const int64_t hd = head_dim_, len = lens_[row], padded = (len + 7) / 8 * 8;
  const int64_t* table = tables_ + row * table_stride_;
  // where token t of this KV head lies
  const auto offset = [&](int64_t t) {
    return ((kv_head * blocks_ + table[t / block_size_]) * block_size_ + t % block_size_) * hd;
  };
  scratch.resize(group * (padded + hd + 1));
  float* probs = scratch.data();         // [group, padded]: past len -inf, whose e^x is 0
  float* acc = probs + group * padded;   // [group, hd]
  float* totals = acc + group * hd;      // [group]
  const float* q = q_ + row * q_row_stride_ + kv_head * group * q_head_stride_;
  const bool vectors = hd % 8 == 0 && block_size_ % 8 == 0;
  if (vectors) {
    for (int64_t t0 = 0; t0 < len; t0 += 8) {
      // eight tokens of one block; past len the last key again, its score overwritten below
      const float* first = k_ + offset(t0);
      if (t0 + 32 < len) prefetch(k_ + offset(t0 + 32), 8 * hd);  // blocks are scattered: ask ahead
      const float* keys[8];
      for (int64_t i = 0; i < 8; ++i) keys[i] = first + std::min(i, len - 1 - t0) * hd;
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * q_head_stride_;
        __m256 sums[8];
        for (int i = 0; i < 8; ++i) sums[i] = _mm256_setzero_ps();
        for (int64_t d = 0; d < hd; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qg + d);
          for (int i = 0; i < 8; ++i) sums[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[i] + d), sums[i]);
        }
        _mm256_storeu_ps(probs + g * padded + t0, _mm256_mul_ps(sum_lanes8(sums), _mm256_set1_ps(scale_)));
      }
    }
  } else {
    for (int64_t t = 0; t < len; ++t) {
      const float* key = k_ + offset(t);
      for (int64_t g = 0; g < group; ++g) probs[g * padded + t] = dot(q + g * q_head_stride_, key, hd) * scale_;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* p = probs + g * padded;
    std::fill(p + len, p + padded, -INFINITY);
    const __m256 top = _mm256_set1_ps(*std::max_element(p, p + len));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < padded; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), top));
      _mm256_storeu_ps(p + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    totals[g] = sum_lanes(sum);
  }
  std::fill_n(acc, group * hd, 0.f);
  const int64_t held = vectors ? hd / 64 * 64 : 0;  // outputs summed in registers, 64 at a time
  for (int64_t g = 0; g < group; ++g) {
    const float* p = probs + g * padded;
    for (int64_t d0 = 0; d0 < held; d0 += 64) {
      __m256 sums[8];
      for (int i = 0; i < 8; ++i) sums[i] = _mm256_setzero_ps();
      for (int64_t t0 = 0; t0 < len; t0 += block_size_) {
        const float* values = v_ + offset(t0) + d0;
        if (g == 0 && d0 == 0 && t0 + block_size_ < len) prefetch(v_ + offset(t0 + block_size_), block_size_ * hd);
        for (int64_t t = t0; t < std::min(len, t0 + block_size_); ++t, values += hd) {
          const __m256 pt = _mm256_set1_ps(p[t]);
          for (int i = 0; i < 8; ++i) sums[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(values + 8 * i), sums[i]);
        }
      }
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + g * hd + d0 + 8 * i, sums[i]);
    }
  }
  if (held < hd) {
    for (int64_t t = 0; t < len; ++t) {
      const float* value = v_ + offset(t) + held;
      for (int64_t g = 0; g < group; ++g) axpy(probs[g * padded + t], value, acc + g * hd + held, hd - held);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* o = out_ + (row * heads_ + kv_head * group + g) * hd;
    for (int64_t i = 0; i < hd; ++i) o[i] = acc[g * hd + i] / totals[g];
  }
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const PagedDecode job(q, k_cache, v_cache, block_table, seq_lens, scale, out);
  at::parallel_for(0, job.tasks(), std::max<int64_t>(1, kWorkPerTask / job.work_per_task()),
                   [&](int64_t begin, int64_t end) {
                     std::vector<float> scratch;
                     for (int64_t task = begin; task < end; ++task) job.run(task, scratch);
                   });
}

}  // namespace stepahead_cpu
