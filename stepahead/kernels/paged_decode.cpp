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
#include <vector>

#include "ops.h"
#include "paged_decode.h"
#include "simd.h"
#include "team.h"

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

// Asks for the cache lines of n values from p.
template <typename T>
inline void prefetch(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) _mm_prefetch(bytes + i, _MM_HINT_T0);
}

// Eight values from p as floats (each exactly).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // the upper half of a float's bits
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// n values from p as floats: p itself, or p's values widened into buffer.
inline const float* as_floats(const float* p, int64_t, float*) { return p; }
template <typename T>
inline const float* as_floats(const T* p, int64_t n, float* buffer) {
  for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(p[i]);
  return buffer;
}

// The scores of query heads g0 .. g0 + G - 1 (q: head g0's vector, heads q_stride apart) against
// eight keys, scaled, into probs (head g0's row; heads padded apart) at t0. Each key vector is widened
// once for the G heads (16-bit widening costs more than the multiply-adds it feeds), four keys at a
// time, so 4 G sums fit in registers. Per score the sum is the same as one head and key at a time:
// head_dim / 8 multiply-adds in order, then sum_lanes8 over the eight keys.
template <int G, typename T>
inline void score_eight(const float* q, int64_t q_stride, const T* const keys[8], int64_t hd, float scale,
                        float* probs, int64_t padded, int64_t t0) {
  __m256 sums[G][8];
  for (int half = 0; half < 8; half += 4) {
    __m256 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
      for (int i = 0; i < 4; ++i) {
        const __m256 key = load8(keys[half + i] + d);
        for (int g = 0; g < G; ++g) acc[g][i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * q_stride + d), key, acc[g][i]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) sums[g][half + i] = acc[g][i];
  }
  for (int g = 0; g < G; ++g)
    _mm256_storeu_ps(probs + g * padded + t0, _mm256_mul_ps(sum_lanes8(sums[g]), _mm256_set1_ps(scale)));
}

// score_eight for all `group` query heads of a row (q: the first head's vector, probs: its row), three
// at a time: the one order of every path's scores.
template <typename T>
inline void score_heads(const float* q, int64_t q_stride, int64_t group, const T* const keys[8], int64_t hd,
                        float scale, float* probs, int64_t padded, int64_t t0) {
  for (int64_t g = 0; g < group; g += 3) {
    const float* qg = q + g * q_stride;
    float* pg = probs + g * padded;
    switch (std::min<int64_t>(3, group - g)) {
      case 3: score_eight<3>(qg, q_stride, keys, hd, scale, pg, padded, t0); break;
      case 2: score_eight<2>(qg, q_stride, keys, hd, scale, pg, padded, t0); break;
      default: score_eight<1>(qg, q_stride, keys, hd, scale, pg, padded, t0);
    }
  }
}

// One token's step of the weighted sums: sums[g][i] += probs[g][t] * value[8 i .. 8 i + 7] for the
// G heads (probs: head g0's row, heads padded apart), value widened once for them. Every path's sums
// take their steps through here, so they round alike.
template <int G, typename T>
__attribute__((always_inline)) inline void add_weighted(__m256 (&sums)[G][4], const float* probs, int64_t padded,
                                                        int64_t t, const T* value) {
  __m256 p[G];
  for (int g = 0; g < G; ++g) p[g] = _mm256_set1_ps(probs[g * padded + t]);
  for (int i = 0; i < 4; ++i) {
    const __m256 v = load8(value + 8 * i);
    for (int g = 0; g < G; ++g) sums[g][i] = _mm256_fmadd_ps(p[g], v, sums[g][i]);
  }
}

// acc[g][d0 .. d0 + 31] = sum over tokens of probs[g][t] * value[t][d0 ..] for heads g0 .. g0 + G - 1
// (probs: head g0's row, heads padded apart; acc: head g0's outputs, heads hd apart). value_at(b):
// where the values of the row's block b start; ask_ahead: ask for each next block's values. Each
// value vector is widened once for the G heads; the sums run in token order, as one head at a time
// would.
template <int G, typename T, typename ValueAt>
inline void weigh_values(const float* probs, int64_t padded, int64_t first_block, int64_t len, int64_t block_size,
                         int64_t d0, const ValueAt& value_at, bool ask_ahead, float* acc, int64_t hd) {
  __m256 sums[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) sums[g][i] = _mm256_setzero_ps();
  for (int64_t b = first_block, t0 = first_block * block_size; t0 < len; ++b, t0 += block_size) {
    const T* values = value_at(b) + d0;
    if (ask_ahead && t0 + block_size < len) prefetch(value_at(b + 1), block_size * hd);
    const int64_t end = std::min(len, t0 + block_size);
    for (int64_t t = t0; t < end; ++t, values += hd) add_weighted<G>(sums, probs, padded, t, values);
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(acc + g * hd + d0 + 8 * i, sums[g][i]);
}

// p[0 .. len) -> e^(p - max), p[len .. padded) -> 0 (padded: len rounded up to eight); returns
// their sum, eight lanes at a time. One row's softmax, the same code for every path.
inline float exponentiate(float* p, int64_t len) {
  const int64_t padded = (len + 7) / 8 * 8;
  std::fill(p + len, p + padded, -INFINITY);  // e^-inf is 0
  __m256 highest = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < padded; t += 8) highest = _mm256_max_ps(highest, _mm256_loadu_ps(p + t));
  const __m256 top = _mm256_set1_ps(max_lanes(highest));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), top));
    _mm256_storeu_ps(p + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  return sum_lanes(sum);
}

// weigh_values over tokens [begin, end) only, continuing the sums held in acc: values holds token
// begin's 32 outputs (from d0), then the next token's hd floats on. Loading the sums from acc and
// storing them back is exact, so spans in token order give weigh_values' bits.
template <int G>
inline void weigh_span(const float* probs, int64_t padded, int64_t begin, int64_t end, const float* values,
                       float* acc, int64_t hd) {
  __m256 sums[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) sums[g][i] = _mm256_loadu_ps(acc + g * hd + 8 * i);
  for (int64_t t = begin; t < end; ++t, values += hd) add_weighted<G>(sums, probs, padded, t, values);
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(acc + g * hd + 8 * i, sums[g][i]);
}

// n values from p as floats into out, eight at a time (n a multiple of eight).
template <typename T>
inline void widen(const T* p, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(out + i, load8(p + i));
}

// Rows a tile holds at most: each widened key then feeds eight rows' scores from L1.
constexpr int64_t kTileRows = 8;
// Tokens whose values a tile widens at a time (a multiple of any block size up to 64).
constexpr int64_t kValueSpan = 64;

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
// attention took a tenth of a 32-row decode step). Up to three heads of the group go together, so a
// 16-bit key or value is widened once for them (vcvtph2ps costs more than the multiply-adds it feeds,
// and widening once per head made a 16-bit cache no faster to read than a float32 one), and the
// weighted sums hold 32 outputs of each in registers across the tokens. The loops go block by block
// (a token's block and place by division cost as much as its scores). A row's blocks lie scattered
// and each is a page of its own, where the hardware prefetchers stop, so the keys two blocks ahead
// and the next block's values are asked for (the gain: docs/BENCHMARKS.md, section 14.4). Each
// output's sums run in the same order as one head and key at a time, and a
// row's arithmetic is fixed by the row alone.
void PagedDecode::run(int64_t task, std::vector<float>& scratch) const {
  switch (cache_type_) {
    case at::kBFloat16: return run_as<c10::BFloat16>(task, scratch);
    case at::kHalf: return run_as<c10::Half>(task, scratch);
    default: return run_as<float>(task, scratch);
  }
}

template <typename T>
void PagedDecode::run_as(int64_t task, std::vector<float>& scratch) const {
  const int64_t tile = task / kv_heads_, kv_head = task % kv_heads_;
  const int64_t first = tile_starts_[tile], end = tile_starts_[tile + 1];
  if (end - first == 1) return run_row<T>(first, kv_head, scratch);
  run_tile<T>(first, end, kv_head, scratch);
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

template <typename T>
void PagedDecode::run_row(int64_t row, int64_t kv_head, std::vector<float>& scratch) const {
  const T* k_cache = static_cast<const T*>(k_);
  const T* v_cache = static_cast<const T*>(v_);
  const int64_t group = heads_ / kv_heads_;
  const int64_t hd = head_dim_, len = lens_[row], padded = (len + 7) / 8 * 8;
  const int64_t* table = tables_ + row * table_stride_;
  // where token t of this KV head lies
  const auto offset = [&](int64_t t) {
    return ((kv_head * blocks_ + table[t / block_size_]) * block_size_ + t % block_size_) * hd;
  };
  // where block b of the row (its tokens b * block_size_ ..) starts, for this KV head
  const auto block_at = [&](int64_t b) { return (kv_head * blocks_ + table[b]) * block_size_ * hd; };
  scratch.resize(group * (padded + hd + 1) + hd);
  float* probs = scratch.data();         // [group, padded]: past len -inf, whose e^x is 0
  float* acc = probs + group * padded;   // [group, hd]
  float* totals = acc + group * hd;      // [group]
  float* widened = totals + group;       // [hd]: one 16-bit key or value as floats (unvectorized path)
  const float* q = q_ + row * q_row_stride_ + kv_head * group * q_head_stride_;
  const bool vectors = hd % 8 == 0 && block_size_ % 8 == 0;
  // Under a window the loops start at its first key's block (vectors) or at the key (one at a time):
  // the blocks before it are never read. lo, a multiple of eight, is where the row's probabilities
  // start; those in [lo, from) are the first block's keys before the window, weighed as 0.
  const int64_t from = first_key(row), first_block = vectors ? from / block_size_ : 0;
  const int64_t lo = vectors ? first_block * block_size_ : from / 8 * 8;
  if (vectors) {
    for (int64_t b = first_block, start = lo; start < len; ++b, start += block_size_) {
      const T* block = k_cache + block_at(b);
      // the block two ahead, whose keys are asked for eight at a time (blocks are scattered)
      const bool ask = start + 2 * block_size_ < len;
      const T* ahead = ask ? k_cache + block_at(b + 2) : nullptr;
      for (int64_t t0 = start; t0 < std::min(len, start + block_size_); t0 += 8) {
        if (ask && t0 + 2 * block_size_ < len) prefetch(ahead + (t0 - start) * hd, 8 * hd);
        // eight tokens of the block; past len the last key again, its score overwritten below
        const T* keys[8];
        for (int64_t i = 0; i < 8; ++i) keys[i] = block + (std::min(t0 + i, len - 1) - start) * hd;
        score_heads(q, q_head_stride_, group, keys, hd, scale_, probs, padded, t0);
      }
    }
  } else {
    for (int64_t t = from; t < len; ++t) {
      const float* key = as_floats(k_cache + offset(t), hd, widened);
      for (int64_t g = 0; g < group; ++g) probs[g * padded + t] = dot(q + g * q_head_stride_, key, hd) * scale_;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* p = probs + g * padded;
    cap_scores(p, from, len);
    std::fill(p + lo, p + from, -INFINITY);
    totals[g] = exponentiate(p + lo, len - lo);
  }
  std::fill_n(acc, group * hd, 0.f);
  const int64_t held = vectors ? hd / 32 * 32 : 0;  // outputs summed in registers, 32 at a time
  const auto value_at = [&](int64_t b) { return v_cache + block_at(b); };
  for (int64_t g = 0; g < group; g += 3) {
    const float* pg = probs + g * padded;
    for (int64_t d0 = 0; d0 < held; d0 += 32) {
      switch (std::min<int64_t>(3, group - g)) {
        case 3: weigh_values<3, T>(pg, padded, first_block, len, block_size_, d0, value_at, g == 0 && d0 == 0, acc + g * hd, hd); break;
        case 2: weigh_values<2, T>(pg, padded, first_block, len, block_size_, d0, value_at, g == 0 && d0 == 0, acc + g * hd, hd); break;
        default: weigh_values<1, T>(pg, padded, first_block, len, block_size_, d0, value_at, g == 0 && d0 == 0, acc + g * hd, hd);
      }
    }
  }
  if (held < hd) {
    for (int64_t t = from; t < len; ++t) {
      const float* value = as_floats(v_cache + offset(t) + held, hd - held, widened);
      for (int64_t g = 0; g < group; ++g) axpy(probs[g * padded + t], value, acc + g * hd + held, hd - held);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* o = out_ + (row * heads_ + kv_head * group + g) * hd;
    for (int64_t i = 0; i < hd; ++i) o[i] = acc[g * hd + i] / totals[g];
  }
}

// The rows [first, end) of a tile against one KV head: each row's arithmetic is run_row's, in the
// same order, so its output bits are those it gets alone; the loops share the work around it. Each
// eight keys are widened once into floats (exact) and scored by every row that reads them, from L1,
// where run_row would read and widen them once per row (a 2,048-token prompt's rows read 2 million
// keys per KV head from L3); each span of values is widened once too and weighed by every row, the
// sums kept in acc between spans.
template <typename T>
void PagedDecode::run_tile(int64_t first, int64_t end, int64_t kv_head, std::vector<float>& scratch) const {
  const T* k_cache = static_cast<const T*>(k_);
  const T* v_cache = static_cast<const T*>(v_);
  const int64_t n = end - first, group = heads_ / kv_heads_, hd = head_dim_;
  const int64_t longest = lens_[end - 1], padded = (longest + 7) / 8 * 8;  // lengths never shrink in a tile
  const int64_t* table = tables_ + (end - 1) * table_stride_;
  const auto block_at = [&](int64_t b) { return (kv_head * blocks_ + table[b]) * block_size_ * hd; };
  scratch.resize(n * group * (padded + hd + 1) + kValueSpan * hd);
  float* probs = scratch.data();               // [n, group, padded]
  float* acc = probs + n * group * padded;     // [n, group, hd]
  float* totals = acc + n * group * hd;        // [n, group]
  float* widened = totals + n * group;         // [kValueSpan, hd]: eight keys, or a span of values
  const float* keys[8];
  for (int64_t i = 0; i < 8; ++i) keys[i] = widened + i * hd;
  const auto q_of = [&](int64_t i) { return q_ + (first + i) * q_row_stride_ + kv_head * group * q_head_stride_; };
  // Under a window, row i's probabilities start at its first key's block, lo(i); the tile's keys and
  // values at the first row's (the rows' windows start in order, lengths never shrinking).
  const auto lo = [&](int64_t i) { return first_key(first + i) / block_size_ * block_size_; };
  const int64_t tile_lo = lo(0);
  for (int64_t b = tile_lo / block_size_, start = tile_lo; start < longest; ++b, start += block_size_) {
    const T* block = k_cache + block_at(b);
    if (start + 2 * block_size_ < longest) prefetch(k_cache + block_at(b + 2), block_size_ * hd);
    for (int64_t t0 = start; t0 < std::min(longest, start + block_size_); t0 += 8) {
      for (int64_t i = 0; i < 8; ++i) widen(block + (std::min(t0 + i, longest - 1) - start) * hd, hd, widened + i * hd);
      for (int64_t i = 0; i < n; ++i) {
        // past a row's length (within these eight) its scores are overwritten below, as run_row's are
        if (t0 >= lens_[first + i] || t0 < lo(i)) continue;
        score_heads(q_of(i), q_head_stride_, group, keys, hd, scale_, probs + i * group * padded, padded, t0);
      }
    }
  }
  for (int64_t i = 0; i < n * group; ++i) {
    const int64_t row = first + i / group, from = first_key(row), row_lo = lo(i / group);
    float* p = probs + i * padded;
    cap_scores(p, from, lens_[row]);
    std::fill(p + row_lo, p + from, -INFINITY);
    totals[i] = exponentiate(p + row_lo, lens_[row] - row_lo);
  }
  std::fill_n(acc, n * group * hd, 0.f);
  for (int64_t span = tile_lo; span < longest; span += kValueSpan) {
    const int64_t span_end = std::min(longest, span + kValueSpan);
    for (int64_t t = span; t < span_end; t += block_size_)
      widen(v_cache + block_at(t / block_size_), std::min(block_size_, span_end - t) * hd, widened + (t - span) * hd);
    for (int64_t i = 0; i < n; ++i) {
      if (span >= lens_[first + i] || span_end <= lo(i)) continue;
      const int64_t begin = std::max(span, lo(i)), stop = std::min(span_end, lens_[first + i]);
      const float* values = widened + (begin - span) * hd;
      for (int64_t g = 0; g < group; g += 3) {
        const float* p = probs + (i * group + g) * padded;
        float* a = acc + (i * group + g) * hd;
        for (int64_t d0 = 0; d0 < hd; d0 += 32) {
          switch (std::min<int64_t>(3, group - g)) {
            case 3: weigh_span<3>(p, padded, begin, stop, values + d0, a + d0, hd); break;
            case 2: weigh_span<2>(p, padded, begin, stop, values + d0, a + d0, hd); break;
            default: weigh_span<1>(p, padded, begin, stop, values + d0, a + d0, hd);
          }
        }
      }
    }
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < group; ++g) {
      float* o = out_ + ((first + i) * heads_ + kv_head * group + g) * hd;
      const float* a = acc + (i * group + g) * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] = a[d] / totals[i * group + g];
    }
}

void PagedDecode::cap_scores(float* scores, int64_t from, int64_t len) const {
  if (softcap_ == 0) return;
  for (int64_t t = from; t < len; ++t) scores[t] = std::tanh(scores[t] / softcap_) * softcap_;
}

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
