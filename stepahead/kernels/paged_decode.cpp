// Decode attention over the paged KV cache on CPU: one new token per row, its keys read through the
// row's block table where they lie, with no gather into a scratch buffer, no padding and no mask.
//
// The cache is head-major, [kv_heads, blocks, block_size, head_dim] float32 (attention/paged_cache.py).
// Query head h attends with KV head h / (heads / kv_heads), as grouped-query checkpoints expect. Each
// (row, KV head) is one task: the scores of its query heads against the row's keys, a softmax, then
// the weighted sum of the values, each in token order. Nothing in a row's arithmetic depends on the
// other rows or the thread that runs it, so a token's attention is bitwise the same in any batch.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

// Multiply-adds a thread should have before a parallel region pays for waking it.
constexpr int64_t kWorkPerTask = 1 << 16;

struct Cache {
  const float* k;
  const float* v;
  int64_t blocks, block_size, head_dim;

  // Where token `t` of KV head `kv_head` lies, for a row whose block table is `table`.
  int64_t offset(int64_t kv_head, const int64_t* table, int64_t t) const {
    return ((kv_head * blocks + table[t / block_size]) * block_size + t % block_size) * head_dim;
  }
};

struct Queries {
  const float* data;
  int64_t row_stride, head_stride;
};

// out += p * v over head_dim floats.
inline void axpy(float p, const float* v, float* out, int64_t n) {
  const __m256 pp = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
  for (; i < n; ++i) out[i] = std::fma(p, v[i], out[i]);
}

// The `group` query heads of one row that share KV head `kv_head`, over the row's `len` keys.
void attend(const Cache& cache, const Queries& q, int64_t row, int64_t kv_head, int64_t group, const int64_t* table,
            int64_t len, float scale, float* out, int64_t out_row_stride) {
  const int64_t hd = cache.head_dim;
  std::vector<float> probs(group * len);
  for (int64_t t = 0; t < len; ++t) {
    const float* key = cache.k + cache.offset(kv_head, table, t);
    for (int64_t g = 0; g < group; ++g) {
      const float* qh = q.data + row * q.row_stride + (kv_head * group + g) * q.head_stride;
      probs[g * len + t] = stepahead_cpu::dot(qh, key, hd) * scale;
    }
  }
  std::vector<float> acc(group * hd, 0.f);
  std::vector<float> total(group, 0.f);
  for (int64_t g = 0; g < group; ++g) {
    float* p = &probs[g * len];
    const float top = *std::max_element(p, p + len);
    for (int64_t t = 0; t < len; ++t) {
      p[t] = std::exp(p[t] - top);
      total[g] += p[t];
    }
  }
  for (int64_t t = 0; t < len; ++t) {
    const float* value = cache.v + cache.offset(kv_head, table, t);
    for (int64_t g = 0; g < group; ++g) axpy(probs[g * len + t], value, &acc[g * hd], hd);
  }
  for (int64_t g = 0; g < group; ++g) {
    float* o = out + row * out_row_stride + (kv_head * group + g) * hd;
    for (int64_t i = 0; i < hd; ++i) o[i] = acc[g * hd + i] / total[g];
  }
}

}  // namespace

namespace stepahead_cpu {

// q [rows, heads, head_dim] (any row and head strides, unit stride within a head), block_table
// [rows, width] int64, seq_lens [rows] int64 (keys per row, its new token included, already in the
// cache), out [rows, heads, head_dim] contiguous.
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1,
              "q must be a float32 [rows, heads, head_dim] tensor with unit stride in head_dim");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous float32 [kv_heads, blocks, block_size, head_dim] tensors");
  const int64_t rows = q.size(0), heads = q.size(1), hd = q.size(2), kv_heads = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == hd && heads % kv_heads == 0, "q's heads must be a multiple of the cache's KV heads");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == rows && block_table.scalar_type() == at::kLong &&
                  block_table.stride(1) == 1,
              "block_table must be an int64 [rows, width] tensor with unit column stride");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == rows && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int64 [rows] tensor");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "out must be a contiguous float32 tensor shaped like q");
  const Cache cache{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.size(1), k_cache.size(2), hd};
  const Queries queries{q.data_ptr<float>(), q.stride(0), q.stride(1)};
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_table.data_ptr<int64_t>();
  const int64_t table_stride = block_table.stride(0), width = block_table.size(1);
  const int64_t group = heads / kv_heads;
  int64_t keys = 0;
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= width * cache.block_size, "row ", r, " has ", lens[r],
                " keys, its block table covers ", width * cache.block_size);
    keys += lens[r];
  }
  const int64_t tasks = rows * kv_heads;
  const int64_t work_per_task = std::max<int64_t>(1, keys / std::max<int64_t>(rows, 1) * group * hd * 2);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tasks, std::max<int64_t>(1, kWorkPerTask / work_per_task), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, kv_head = task % kv_heads;
      attend(cache, queries, row, kv_head, group, tables + row * table_stride, lens[row], static_cast<float>(scale),
             op, heads * hd);
    }
  });
}

}  // namespace stepahead_cpu
