// PagedDecode's loops (paged_decode.cpp says what they compute and why), written once over a vector
// width V: paged_decode.cpp instantiates them for AVX2 (AvxLanes8: __m256, eight floats) and
// paged_decode_avx512.cpp, under a target pragma, for AVX-512 (AvxLanes16: __m512, sixteen floats).
// V holds Vec, kLanes, kHeadsTogether (query heads that go through the keys and values together) and
// the operations: zero, set1, loadf, load (of float, bfloat16 or float16 values, each exactly), store,
// fmadd, max, add, sub, exp, fold8 (a Vec's lanes added into eight, in a fixed order), sum_lanes and
// max_lanes.
//
// Everything here lies in an anonymous namespace, so each of the two files compiles its own copy
// with its own instructions: a helper shared between them would be one symbol, and the linker could
// hand the AVX2 path the copy compiled for AVX-512.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "paged_decode.h"
#include "simd.h"

namespace stepahead_cpu {

namespace {

// Rows a tile holds at most: each widened key then feeds eight rows' scores from L1.
constexpr int64_t kTileRows = 8;
// Tokens whose values a tile widens at a time (a multiple of any block size up to 64).
constexpr int64_t kValueSpan = 64;

// out += p * v over n floats (the part of a head past its multiple of 4 * kLanes).
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
// head_dim / kLanes multiply-adds in order, fold8, then sum_lanes8 over the eight keys.
template <class V, int G, typename T>
inline void score_eight(const float* q, int64_t q_stride, const T* const keys[8], int64_t hd, float scale,
                        float* probs, int64_t padded, int64_t t0) {
  __m256 sums[G][8];
  for (int half = 0; half < 8; half += 4) {
    typename V::Vec acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) acc[g][i] = V::zero();
    for (int64_t d = 0; d < hd; d += V::kLanes) {
      for (int i = 0; i < 4; ++i) {
        const typename V::Vec key = V::load(keys[half + i] + d);
        for (int g = 0; g < G; ++g) acc[g][i] = V::fmadd(V::loadf(q + g * q_stride + d), key, acc[g][i]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) sums[g][half + i] = V::fold8(acc[g][i]);
  }
  for (int g = 0; g < G; ++g)
    _mm256_storeu_ps(probs + g * padded + t0, _mm256_mul_ps(sum_lanes8(sums[g]), _mm256_set1_ps(scale)));
}

// Calls f.template operator()<G>(g) for g = 0, kHeadsTogether, ... < group, G the heads from g on
// that go together: one pass over the keys or values for up to kHeadsTogether heads.
template <class V, class F>
inline void by_head_groups(int64_t group, const F& f) {
  for (int64_t g = 0; g < group; g += V::kHeadsTogether) {
    switch (std::min<int64_t>(V::kHeadsTogether, group - g)) {
      case 4:
        if constexpr (V::kHeadsTogether >= 4) f.template operator()<4>(g);
        break;
      case 3: f.template operator()<3>(g); break;
      case 2: f.template operator()<2>(g); break;
      default: f.template operator()<1>(g);
    }
  }
}

// score_eight for all `group` query heads of a row (q: the first head's vector, probs: its row),
// kHeadsTogether at a time: the one order of every path's scores.
template <class V, typename T>
inline void score_heads(const float* q, int64_t q_stride, int64_t group, const T* const keys[8], int64_t hd,
                        float scale, float* probs, int64_t padded, int64_t t0) {
  by_head_groups<V>(group, [&]<int G>(int64_t g) {
    score_eight<V, G>(q + g * q_stride, q_stride, keys, hd, scale, probs + g * padded, padded, t0);
  });
}

// One token's step of the weighted sums: sums[g][i] += probs[g][t] * value[kLanes i ..] for the G
// heads (probs: head g0's row, heads padded apart), value widened once for them. Every path's sums
// take their steps through here, so they round alike.
template <class V, int G, typename T>
__attribute__((always_inline)) inline void add_weighted(typename V::Vec (&sums)[G][4], const float* probs,
                                                        int64_t padded, int64_t t, const T* value) {
  typename V::Vec p[G];
  for (int g = 0; g < G; ++g) p[g] = V::set1(probs[g * padded + t]);
  for (int i = 0; i < 4; ++i) {
    const typename V::Vec v = V::load(value + V::kLanes * i);
    for (int g = 0; g < G; ++g) sums[g][i] = V::fmadd(p[g], v, sums[g][i]);
  }
}

// acc[g][d0 .. d0 + 4 kLanes) = sum over tokens of probs[g][t] * value[t][d0 ..] for heads g0 .. g0 +
// G - 1 (probs: head g0's row, heads padded apart; acc: head g0's outputs, heads hd apart).
// value_at(b): where the values of the row's block b start (asked for while the keys were scored).
// Each value vector is widened once for the G heads; the sums run in token order, as one head at a
// time would.
template <class V, int G, typename T, typename ValueAt>
inline void weigh_values(const float* probs, int64_t padded, int64_t first_block, int64_t len, int64_t block_size,
                         int64_t d0, const ValueAt& value_at, float* acc, int64_t hd) {
  typename V::Vec sums[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) sums[g][i] = V::zero();
  for (int64_t b = first_block, t0 = first_block * block_size; t0 < len; ++b, t0 += block_size) {
    const T* values = value_at(b) + d0;
    const int64_t end = std::min(len, t0 + block_size);
    for (int64_t t = t0; t < end; ++t, values += hd) add_weighted<V, G>(sums, probs, padded, t, values);
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) V::store(acc + g * hd + d0 + V::kLanes * i, sums[g][i]);
}

// p[0 .. len) -> e^(p - max), p[len .. len rounded up to kLanes) -> 0; returns their sum, kLanes at a
// time. One row's softmax, the same code for every path. The row's buffer must hold len rounded up to
// eight plus eight floats (probs_stride).
template <class V>
inline float exponentiate(float* p, int64_t len) {
  const int64_t padded = (len + V::kLanes - 1) / V::kLanes * V::kLanes;
  std::fill(p + len, p + padded, -INFINITY);  // e^-inf is 0
  typename V::Vec highest = V::set1(-INFINITY);
  for (int64_t t = 0; t < padded; t += V::kLanes) highest = V::max(highest, V::loadf(p + t));
  const typename V::Vec top = V::set1(V::max_lanes(highest));
  typename V::Vec sum = V::zero();
  for (int64_t t = 0; t < padded; t += V::kLanes) {
    const typename V::Vec e = V::exp(V::sub(V::loadf(p + t), top));
    V::store(p + t, e);
    sum = V::add(sum, e);
  }
  return V::sum_lanes(sum);
}

// Floats between two heads' (or rows') probabilities for len keys: len rounded up to eight, where the
// scores of eight keys at a time land, and eight more, where a row whose probabilities start at a
// multiple of eight is padded to sixteen by exponentiate.
inline int64_t probs_stride(int64_t len) { return (len + 7) / 8 * 8 + 8; }

// weigh_values over tokens [begin, end) only, continuing the sums held in acc: values holds token
// begin's 4 kLanes outputs (from d0), then the next token's hd floats on. Loading the sums from acc
// and storing them back is exact, so spans in token order give weigh_values' bits.
template <class V, int G>
inline void weigh_span(const float* probs, int64_t padded, int64_t begin, int64_t end, const float* values,
                       float* acc, int64_t hd) {
  typename V::Vec sums[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) sums[g][i] = V::loadf(acc + g * hd + V::kLanes * i);
  for (int64_t t = begin; t < end; ++t, values += hd) add_weighted<V, G>(sums, probs, padded, t, values);
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) V::store(acc + g * hd + V::kLanes * i, sums[g][i]);
}

// n values from p as floats into out, kLanes at a time (n a multiple of kLanes).
template <class V, typename T>
inline void widen(const T* p, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += V::kLanes) V::store(out + i, V::load(p + i));
}

}  // namespace

template <typename T, class V>
void PagedDecode::run_as(int64_t task, std::vector<float>& scratch) const {
  const int64_t tile = task / kv_heads_, kv_head = task % kv_heads_;
  const int64_t first = tile_starts_[tile], end = tile_starts_[tile + 1];
  if (end - first == 1) return run_row<T, V>(first, kv_head, scratch);
  run_tile<T, V>(first, end, kv_head, scratch);
}

template <typename T, class V>
void PagedDecode::run_row(int64_t row, int64_t kv_head, std::vector<float>& scratch) const {
  const T* k_cache = static_cast<const T*>(k_);
  const T* v_cache = static_cast<const T*>(v_);
  const int64_t group = heads_ / kv_heads_;
  const int64_t hd = head_dim_, len = lens_[row], padded = probs_stride(len);
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
  const bool vectors = hd % V::kLanes == 0 && block_size_ % 8 == 0;
  // Under a window the loops start at its first key's block (vectors) or at the key (one at a time):
  // the blocks before it are never read. lo, a multiple of eight, is where the row's probabilities
  // start; those in [lo, from) are the first block's keys before the window, weighed as 0.
  const int64_t from = first_key(row), first_block = vectors ? from / block_size_ : 0;
  const int64_t lo = vectors ? first_block * block_size_ : from / 8 * 8;
  if (vectors) {
    for (int64_t b = first_block, start = lo; start < len; ++b, start += block_size_) {
      const T* block = k_cache + block_at(b);
      // The keys of the block two ahead are asked for eight at a time (blocks are scattered, each a
      // page the hardware prefetchers stop at), and this block's values, which the weighted sums
      // read after the softmax: from memory alongside the keys, not after them (a 32-row step's
      // attention over 30 layers' caches, 2.0 -> 1.7 ms per layer at 512 keys).
      const bool ask = start + 2 * block_size_ < len;
      const T* ahead = ask ? k_cache + block_at(b + 2) : nullptr;
      const T* values = v_cache + block_at(b);
      for (int64_t t0 = start; t0 < std::min(len, start + block_size_); t0 += 8) {
        if (ask && t0 + 2 * block_size_ < len) prefetch(ahead + (t0 - start) * hd, 8 * hd);
        prefetch(values + (t0 - start) * hd, std::min<int64_t>(8, len - t0) * hd);
        // eight tokens of the block; past len the last key again, its score overwritten below
        const T* keys[8];
        for (int64_t i = 0; i < 8; ++i) keys[i] = block + (std::min(t0 + i, len - 1) - start) * hd;
        score_heads<V>(q, q_head_stride_, group, keys, hd, scale_, probs, padded, t0);
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
    totals[g] = exponentiate<V>(p + lo, len - lo);
  }
  std::fill_n(acc, group * hd, 0.f);
  constexpr int64_t kSpan = 4 * V::kLanes;  // outputs summed in registers at a time
  const int64_t held = vectors ? hd / kSpan * kSpan : 0;
  const auto value_at = [&](int64_t b) { return v_cache + block_at(b); };
  by_head_groups<V>(group, [&]<int G>(int64_t g) {
    for (int64_t d0 = 0; d0 < held; d0 += kSpan)
      weigh_values<V, G, T>(probs + g * padded, padded, first_block, len, block_size_, d0, value_at, acc + g * hd,
                            hd);
  });
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
// sums kept in acc between spans. Tiles need heads of a multiple of 4 kLanes (the constructor's).
template <typename T, class V>
void PagedDecode::run_tile(int64_t first, int64_t end, int64_t kv_head, std::vector<float>& scratch) const {
  const T* k_cache = static_cast<const T*>(k_);
  const T* v_cache = static_cast<const T*>(v_);
  const int64_t n = end - first, group = heads_ / kv_heads_, hd = head_dim_;
  const int64_t longest = lens_[end - 1], padded = probs_stride(longest);  // lengths never shrink in a tile
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
      for (int64_t i = 0; i < 8; ++i)
        widen<V>(block + (std::min(t0 + i, longest - 1) - start) * hd, hd, widened + i * hd);
      for (int64_t i = 0; i < n; ++i) {
        // past a row's length (within these eight) its scores are overwritten below, as run_row's are
        if (t0 >= lens_[first + i] || t0 < lo(i)) continue;
        score_heads<V>(q_of(i), q_head_stride_, group, keys, hd, scale_, probs + i * group * padded, padded, t0);
      }
    }
  }
  for (int64_t i = 0; i < n * group; ++i) {
    const int64_t row = first + i / group, from = first_key(row), row_lo = lo(i / group);
    float* p = probs + i * padded;
    cap_scores(p, from, lens_[row]);
    std::fill(p + row_lo, p + from, -INFINITY);
    totals[i] = exponentiate<V>(p + row_lo, lens_[row] - row_lo);
  }
  std::fill_n(acc, n * group * hd, 0.f);
  constexpr int64_t kSpan = 4 * V::kLanes;
  for (int64_t span = tile_lo; span < longest; span += kValueSpan) {
    const int64_t span_end = std::min(longest, span + kValueSpan);
    for (int64_t t = span; t < span_end; t += block_size_)
      widen<V>(v_cache + block_at(t / block_size_), std::min(block_size_, span_end - t) * hd,
               widened + (t - span) * hd);
    for (int64_t i = 0; i < n; ++i) {
      if (span >= lens_[first + i] || span_end <= lo(i)) continue;
      const int64_t begin = std::max(span, lo(i)), stop = std::min(span_end, lens_[first + i]);
      const float* values = widened + (begin - span) * hd;
      by_head_groups<V>(group, [&]<int G>(int64_t g) {
        const float* p = probs + (i * group + g) * padded;
        float* a = acc + (i * group + g) * hd;
        for (int64_t d0 = 0; d0 < hd; d0 += kSpan) weigh_span<V, G>(p, padded, begin, stop, values + d0, a + d0, hd);
      });
    }
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < group; ++g) {
      float* o = out_ + ((first + i) * heads_ + kv_head * group + g) * hd;
      const float* a = acc + (i * group + g) * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] = a[d] / totals[i * group + g];
    }
}

}  // namespace stepahead_cpu
