// The packed weight formats' codes as the GEMM's tile functions unpack them, for vectors of 256 bits
// (packed_gemm.cpp) and of 512 bits (packed_gemm_zmm.cpp, two tiles side by side): one description of
// each record's bit layout (packed_gemm.h) for both.
//
// Internal to those two files, and everything here has internal linkage: packed_gemm_zmm.cpp includes
// this header where GCC compiles for AVX-512, and that code must never stand in for the AVX2 file's.
// The lane operations a format uses (srli16, slli16, srai16, and16, or16, sub16) are overloaded on the
// vector type; the 512-bit ones are declared by packed_gemm_zmm.cpp before it includes this header.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "packed_gemm.h"
#include "simd.h"
#include "warmer.h"

namespace stepahead_cpu {

// One tile function: rows row .. row + R of xq times some column tiles from tile t, into out.
using TileFn = void (*)(const QuantizedRows&, int64_t row, const PackedWeight&, const Output&, int64_t t);
// One work item: M rows times `count` column tiles from tile t.
using BlockFn = void (*)(const PackedWeight&, const QuantizedRows&, int64_t M, int64_t t, int64_t count,
                         const Output&, Warmer*);

// The 512-bit work item for a format (packed_gemm_zmm.cpp): for blocks of two tiles only, and only on a
// CPU with AVX-512 F, BW, VL and VNNI; nullptr where the compiler built none.
BlockFn zmm_block_runner(PackedWeight::Format format);

namespace {

// How many groups ahead of its reads a one-row call asks for weight records (tile): ~8 KB of 4-bit
// records.
constexpr int64_t kPrefetchGroups = 48;

// Cache lines a warmer (warmer.h) asks for before each tile of four rows: a 32-row step's next attention
// (3-5 MB) is asked for within the next layer's projections, and 32 or 64 lines slowed them more.
constexpr int kWarmLinesPerTile = 16;


inline __m256i srli16(__m256i v, int n) { return _mm256_srli_epi16(v, n); }
inline __m256i slli16(__m256i v, int n) { return _mm256_slli_epi16(v, n); }
inline __m256i srai16(__m256i v, int n) { return _mm256_srai_epi16(v, n); }
inline __m256i and16(__m256i v, int16_t mask) { return _mm256_and_si256(v, _mm256_set1_epi16(mask)); }
inline __m256i or16(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
inline __m256i sub16(__m256i v, int16_t value) { return _mm256_sub_epi16(v, _mm256_set1_epi16(value)); }

// The weight formats. A record's codes are chunks of 32 bytes, each read as 16 int16 lanes (a 512-bit
// vector holds two tiles' chunks, one per half): lane 2c + e of chunk j holds, in its slot s (kSlots
// per lane), the code of the tile's column c at input 2 * (kSlots * j + s) + e of the group, so that
// `unpack(chunk, s)` gives the codes of one pair of inputs for the eight columns, as vpmaddwd
// multiplies them with the pair's activation codes.
// Q4: nibbles, codes 0..15, w = q * scale + min. Q8 (GGUF's Q8_0 blocks): signed bytes, w = q * scale.
struct Q4 {
  static constexpr PackedWeight::Format kFormat = PackedWeight::Format::kQ4;
  static constexpr bool kSuper = false;
  static constexpr int kSlots = 4, kChunks = 4;
  static constexpr bool kHasMins = true, kHigh = false;
  template <typename V>
  static V unpack(V chunk, int s) {
    if (s == 3) return srli16(chunk, 12);
    return and16(srli16(chunk, 4 * s), 0x0f);
  }
  template <typename V>
  static V code(V chunk, V, int, int s) { return unpack(chunk, s); }
};

// Bit b = 4 j + s of each int16 lane of `high` moved to bit 4 (a 5-bit code's fifth bit).
template <typename V>
inline V fifth_bit(V high, int j, int s) {
  const int b = 4 * j + s;
  return and16(b >= 4 ? srli16(high, b - 4) : slli16(high, 4 - b), 0x10);
}

// Q5 (GGUF's Q5_0, Q5_1): Q4's nibbles with the fifth bits in one chunk after them.
struct Q5 {
  static constexpr PackedWeight::Format kFormat = PackedWeight::Format::kQ5;
  static constexpr bool kSuper = false;
  static constexpr int kSlots = 4, kChunks = 4;
  static constexpr bool kHasMins = true, kHigh = true;
  template <typename V>
  static V code(V chunk, V high, int j, int s) { return or16(Q4::unpack(chunk, s), fifth_bit(high, j, s)); }
};

struct Q8 {
  static constexpr PackedWeight::Format kFormat = PackedWeight::Format::kQ8;
  static constexpr bool kSuper = false;
  static constexpr int kSlots = 2, kChunks = 8;
  static constexpr bool kHasMins = false, kHigh = false;
  template <typename V>
  static V code(V chunk, V, int, int s) {
    if (s == 0) return srai16(slli16(chunk, 8), 8);
    return srai16(chunk, 8);
  }
};

// The k-quants (packed_gemm.h): a group's low nibbles are Q4's chunks, and `code(chunk, high, j, s)`
// adds the high bits of pair b = 4 j + s from the group's high chunks. kSubBlocks: scales per group of
// 32 (Q6_K's sub-blocks are 16 inputs, two nibble chunks); kSignedScales: Q6_K's int8 scales; kOffset:
// subtracted from each code (Q6_K's 32), where Q4_K and Q5_K have mins.
template <PackedWeight::Format F, int HighChunks, int SubBlocks, bool SignedScales, int Offset>
struct KQuant {
  static constexpr PackedWeight::Format kFormat = F;
  static constexpr bool kSuper = true;
  static constexpr int kHighChunks = HighChunks, kSubBlocks = SubBlocks;
  static constexpr bool kSignedScales = SignedScales, kHasMins = Offset == 0;
  template <typename V>
  static V code(V chunk, const V* high, int j, int s) {
    const V low = Q4::unpack(chunk, s);
    const int b = 4 * j + s;
    if constexpr (HighChunks == 0) {
      return low;
    } else if constexpr (HighChunks == 1) {  // bit b of the lane is the code's bit 4
      return or16(low, fifth_bit(high[0], j, s));
    } else {  // bits 2 (b % 8) and the next of chunk b / 8 are the code's bits 4 and 5
      const int at = 2 * (b % 8);
      const V c = high[b / 8];
      const V h = at >= 4 ? srli16(c, at - 4) : slli16(c, 4 - at);
      return sub16(or16(low, and16(h, 0x30)), Offset);
    }
  }
};
using Q4K = KQuant<PackedWeight::Format::kQ4K, 0, 1, false, 0>;
using Q5K = KQuant<PackedWeight::Format::kQ5K, 1, 1, false, 0>;
using Q6K = KQuant<PackedWeight::Format::kQ6K, 2, 2, true, 32>;

// A tile's sums into y: rounded to bfloat16 values, plus the bias, added to y where out accumulates.
// acc[r][c]: row `row + r`, the eight columns of tile t + c.
template <int R, int C>
inline void store(const __m256 (&acc)[R][C], int64_t row, const PackedWeight& w, const Output& out, int64_t t) {
  for (int c = 0; c < C; ++c) {
    const int64_t n = (t + c) * kTileColumns, columns = std::min(kTileColumns, w.N - n);
    for (int r = 0; r < R; ++r) {
      alignas(32) float v[kTileColumns];
      _mm256_store_ps(v, round_to_bf16(acc[r][c]));
      float* y = out.y + (row + r) * (out.stride ? out.stride : w.N) + n;
      for (int64_t i = 0; i < columns; ++i) {
        const float value = w.bias != nullptr ? v[i] + w.bias[n + i] : v[i];
        y[i] = out.accumulate ? y[i] + value : value;
      }
    }
  }
}

}  // namespace
}  // namespace stepahead_cpu
