// The packed GEMM's tiles on 512-bit vectors, for CPUs with AVX-512 F, BW, VL and VNNI (packed_gemm.cpp
// chooses them once per process; STEPAHEAD_MAX_CPU_ISA=avx2 or avx512_vnni keeps the 256-bit ones).
//
// A work item's two tiles of eight columns sit side by side in one vector: lanes 0-7 tile t, lanes
// 8-15 tile t + 1, each half loaded from its own tile's record. So one unpacking and one vpdpwssd
// serve sixteen columns, where the 256-bit tiles need two of each. With 32 registers a tile takes up to
// eight rows (kMaxRows): a call of one to eight rows, as a speculative step's 1 + k rows, reads the
// weights once; more rows go eight at a time, then the rest in one pass.
//
// The same bits as the 256-bit tiles: the integer sums of a group are exact whatever their order (a
// row of few rows keeps two or four partial sums, so that its vpdpwssd do not wait on each other, and
// adds them, exact too), and each lane's float sums take the same operations in the same order
// (convert, scale times dx, fused multiply-add, then the min's), as lane c of the 256-bit tile's.
//
// Only this file is compiled for AVX-512 (the pragma below, after the headers whose code the rest of
// the extension shares; what it defines after the pragma has internal linkage, so no AVX-512 copy of a
// shared function can stand in for the AVX2 one).

#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "packed_gemm.h"
#include "simd.h"
#include "warmer.h"

// GCC's target pragma; another compiler builds no 512-bit tiles (zmm_block_runner says so).
#if defined(__GNUC__) && !defined(__clang__)
#define STEPAHEAD_ZMM_TILES 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

namespace stepahead_cpu {
namespace {

// packed_codes.h's lane operations on 512-bit vectors.
inline __m512i srli16(__m512i v, int n) { return _mm512_srli_epi16(v, n); }
inline __m512i slli16(__m512i v, int n) { return _mm512_slli_epi16(v, n); }
inline __m512i srai16(__m512i v, int n) { return _mm512_srai_epi16(v, n); }
inline __m512i and16(__m512i v, int16_t mask) { return _mm512_and_si512(v, _mm512_set1_epi16(mask)); }
inline __m512i or16(__m512i a, __m512i b) { return _mm512_or_si512(a, b); }
inline __m512i sub16(__m512i v, int16_t value) { return _mm512_sub_epi16(v, _mm512_set1_epi16(value)); }

}  // namespace
}  // namespace stepahead_cpu

#include "packed_codes.h"

namespace stepahead_cpu {
namespace {

constexpr int kMaxRows = 8;

// Independent vpdpwssd chains per row: a row's chain waits on its previous product, so rows of few
// rows split each group's sum in two or four.
template <int R>
constexpr int kChains = R == 1 ? 4 : R < 4 ? 2 : 1;

// 32 bytes of tile t's record (low half) and the same 32 of tile t + 1's.
inline __m512i load_two(const uint8_t* first, const uint8_t* second) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second)), 1);
}

// Eight float16 values of each of two records, widened (exactly) to 16 floats.
inline __m512 halves_two(const uint8_t* first, const uint8_t* second) {
  const __m256i h = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(first))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(second)), 1);
  return _mm512_cvtph_ps(h);
}

// Eight bytes of each of two records, widened to 16 int32 lanes (signed or not).
template <bool Signed>
inline __m512i bytes_two(const uint8_t* first, const uint8_t* second) {
  const __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(first)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(second)));
  return Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
}

// A row's activation codes of inputs `at` and at + 1, in every int32 lane.
inline __m512i pair_of(const int16_t* qx, int64_t at) {
  int32_t pair;
  std::memcpy(&pair, qx + at, sizeof(pair));
  return _mm512_set1_epi32(pair);
}

// A group's partial sums of each row added (exact) into chain 0.
template <int R, int P>
inline void join_chains(__m512i (&sums)[R][P]) {
  for (int r = 0; r < R; ++r)
    for (int p = 1; p < P; ++p) sums[r][0] = _mm512_add_epi32(sums[r][0], sums[r][p]);
}

// Asks for the records `ahead` bytes past each of the two tiles' current ones.
inline void prefetch_two(const uint8_t* record, int64_t next_tile, int64_t ahead, int64_t bytes) {
  for (int c = 0; c < 2; ++c)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(record + c * next_tile + ahead + b), _MM_HINT_T0);
}

// The sums of rows row .. row + R into y: each half is a 256-bit tile's, stored as packed_gemm.cpp stores.
template <int R>
inline void store_two(const __m512 (&acc)[R], int64_t row, const PackedWeight& w, const Output& out, int64_t t) {
  __m256 halves[R][2];
  for (int r = 0; r < R; ++r) {
    halves[r][0] = _mm512_castps512_ps256(acc[r]);
    halves[r][1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1));
  }
  store<R, 2>(halves, row, w, out, t);
}

// packed_gemm.cpp's tile for Q4, Q5 and Q8 records, rows row .. row + R by tiles t and t + 1.
template <typename F, int R>
__attribute__((noinline)) void tile(const QuantizedRows& xq, int64_t row, const PackedWeight& w, const Output& out,
                                    int64_t t) {
  constexpr int64_t kRecord = record_bytes(F::kFormat), kCodeBytes = code_bytes(F::kFormat);
  constexpr int P = kChains<R>;
  const int64_t groups = w.K / kGroup, x_groups = xq.row_stride / kGroup;
  const int64_t next_tile = groups * kRecord;  // from a record of tile t to tile t + 1's
  const uint8_t* tiles = w.tiles + t * next_tile;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  // The first pass over the two tiles reads their records from memory: ask for them kPrefetchGroups
  // ahead, whatever its rows (with half the instructions of the 256-bit tiles, four to eight rows wait
  // on memory too: docs/BENCHMARKS.md, section 14.4); later passes find them in cache.
  const bool prefetch = row == 0;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = tiles + g * kRecord;
    const int16_t* qx = xq.codes + row * xq.row_stride + g * kGroup;
    if (prefetch) prefetch_two(record, next_tile, kPrefetchGroups * kRecord, kRecord);
    __m512i sums[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) sums[r][p] = _mm512_setzero_si512();
    const __m512i high =
        F::kHigh ? load_two(record + 32 * F::kChunks, record + next_tile + 32 * F::kChunks) : _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < F::kChunks; ++j) {
      const __m512i chunk = load_two(record + 32 * j, record + next_tile + 32 * j);
#pragma GCC unroll 4
      for (int s = 0; s < F::kSlots; ++s) {
        const __m512i codes = F::code(chunk, high, j, s);
        const int pair = F::kSlots * j + s;
        for (int r = 0; r < R; ++r)
          sums[r][pair % P] = _mm512_dpwssd_epi32(sums[r][pair % P], codes, pair_of(qx + r * xq.row_stride, 2 * pair));
      }
    }
    join_chains(sums);
    const __m512 scales = halves_two(record + kCodeBytes, record + next_tile + kCodeBytes);
    __m512 mins = _mm512_setzero_ps();
    if constexpr (F::kHasMins) mins = halves_two(record + kCodeBytes + 16, record + next_tile + kCodeBytes + 16);
    for (int r = 0; r < R; ++r) {
      const int64_t x_group = (row + r) * x_groups + g;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][0]), _mm512_mul_ps(scales, _mm512_set1_ps(xq.scales[x_group])),
                               acc[r]);
      if constexpr (F::kHasMins) acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xq.sums[x_group]), acc[r]);
    }
  }
  store_two<R>(acc, row, w, out, t);
}

// packed_gemm.cpp's ktile for the k-quants' records, rows row .. row + R by tiles t and t + 1.
template <typename F, int R>
__attribute__((noinline)) void ktile(const QuantizedRows& xq, int64_t row, const PackedWeight& w, const Output& out,
                                     int64_t t) {
  constexpr int64_t kRecord = record_bytes(F::kFormat), kHeader = kquant_header_bytes(F::kFormat);
  constexpr int64_t kGroupBytes = kquant_group_bytes(F::kFormat), kGroups = kSuperBlock / kGroup;
  constexpr int kChunksPerSub = (kGroup / 2 / 4) / F::kSubBlocks;  // nibble chunks per sub-block
  constexpr int P = kChains<R>;
  constexpr int64_t kScalesAt = F::kHasMins ? 32 : 16;
  const int64_t supers = w.K / kSuperBlock, x_groups = xq.row_stride / kGroup;
  const int64_t next_tile = supers * kRecord;
  const uint8_t* tiles = w.tiles + t * next_tile;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const bool prefetch = row == 0;  // as tile's
  constexpr int64_t kPrefetchSupers =
      (kPrefetchGroups * record_bytes(PackedWeight::Format::kQ4) + kRecord - 1) / kRecord;
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* record = tiles + sb * kRecord;
    if (prefetch) prefetch_two(record, next_tile, kPrefetchSupers * kRecord, kRecord);
    const __m512 d = halves_two(record, record + next_tile);
    __m512 neg_dmin = _mm512_setzero_ps();
    if constexpr (F::kHasMins) neg_dmin = halves_two(record + 16, record + next_tile + 16);
    for (int64_t g = 0; g < kGroups; ++g) {
      const int64_t x_group = sb * kGroups + g;
      const int16_t* qx = xq.codes + row * xq.row_stride + x_group * kGroup;
      const uint8_t* group = record + kHeader + g * kGroupBytes;
      __m512i high[F::kHighChunks > 0 ? F::kHighChunks : 1];
      for (int h = 0; h < F::kHighChunks; ++h) high[h] = load_two(group + 128 + 32 * h, group + next_tile + 128 + 32 * h);
#pragma GCC unroll 2
      for (int sub = 0; sub < F::kSubBlocks; ++sub) {
        __m512i sums[R][P];
        for (int r = 0; r < R; ++r)
          for (int p = 0; p < P; ++p) sums[r][p] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int jj = 0; jj < kChunksPerSub; ++jj) {
          const int j = sub * kChunksPerSub + jj;
          const __m512i chunk = load_two(group + 32 * j, group + next_tile + 32 * j);
#pragma GCC unroll 4
          for (int s = 0; s < 4; ++s) {
            const __m512i codes = F::code(chunk, high, j, s);
            const int pair = 4 * j + s;
            for (int r = 0; r < R; ++r)
              sums[r][pair % P] =
                  _mm512_dpwssd_epi32(sums[r][pair % P], codes, pair_of(qx + r * xq.row_stride, 2 * pair));
          }
        }
        join_chains(sums);
        const int64_t at = kScalesAt + (g * F::kSubBlocks + sub) * 8;
        const __m512 scale =
            _mm512_mul_ps(d, _mm512_cvtepi32_ps(bytes_two<F::kSignedScales>(record + at, record + next_tile + at)));
        for (int r = 0; r < R; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][0]),
                                   _mm512_mul_ps(scale, _mm512_set1_ps(xq.scales[(row + r) * x_groups + x_group])),
                                   acc[r]);
      }
      if constexpr (F::kHasMins) {
        const int64_t at = 32 + 64 + g * 8;
        const __m512 mins =
            _mm512_mul_ps(neg_dmin, _mm512_cvtepi32_ps(bytes_two<false>(record + at, record + next_tile + at)));
        for (int r = 0; r < R; ++r)
          acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xq.sums[(row + r) * x_groups + x_group]), acc[r]);
      }
    }
  }
  store_two<R>(acc, row, w, out, t);
}

template <typename F, int R>
constexpr TileFn tile_for() {
  if constexpr (F::kSuper) return ktile<F, R>;
  else return tile<F, R>;
}

template <typename F, int... R>
constexpr TileFn shapes[] = {nullptr, tile_for<F, R>()...};

// y[:, columns of tiles t, t + 1] (count is 2: multiply gives an odd block's last tile to the 256-bit
// tiles): up to eight rows per pass over the two tiles' weights.
template <typename F>
void block_of(const PackedWeight& w, const QuantizedRows& xq, int64_t M, int64_t t, int64_t,
              const Output& out, Warmer* warmer) {
  constexpr const TileFn* by_rows = shapes<F, 1, 2, 3, 4, 5, 6, 7, 8>;
  for (int64_t row = 0; row < M; row += kMaxRows) {
    const int64_t rows = std::min<int64_t>(kMaxRows, M - row);
    // as many lines as the 256-bit tiles ask for over these rows and columns
    if (warmer != nullptr) warmer->step(kWarmLinesPerTile * static_cast<int>((rows + 3) / 4));
    by_rows[rows](xq, row, w, out, t);
  }
}

}  // namespace
}  // namespace stepahead_cpu

#pragma GCC pop_options
#else
#include "packed_codes.h"
#endif  // defined(__GNUC__) && !defined(__clang__)

namespace stepahead_cpu {

BlockFn zmm_block_runner(PackedWeight::Format format) {
#ifndef STEPAHEAD_ZMM_TILES
  return nullptr;
#else
  switch (format) {
    case PackedWeight::Format::kQ4: return block_of<Q4>;
    case PackedWeight::Format::kQ8: return block_of<Q8>;
    case PackedWeight::Format::kQ5: return block_of<Q5>;
    case PackedWeight::Format::kQ4K: return block_of<Q4K>;
    case PackedWeight::Format::kQ5K: return block_of<Q5K>;
    case PackedWeight::Format::kQ6K: return block_of<Q6K>;
  }
  TORCH_CHECK(false, "unknown packed weight format");
#endif
}

}  // namespace stepahead_cpu
