// The packed GEMM on AMX-INT8 tiles: blocks of 16 rows by 16 columns (two tiles of eight), the same
// bits as packed_gemm.cpp's vector tiles.
//
// Why the bits match: a group's sum(q * qx) of 32 products is an exact int32 whichever instruction
// computes it, and after it the float arithmetic is the vector tiles', lane for lane (the float16
// scales widened, the scale times the row's dx, one fused multiply-add of the converted sum, then one
// of the min and the row's dx * sum(qx), group after group; then the bf16 rounding, the bias and the
// accumulation of `store`). Only the instructions that build the integer sums differ.
//
// The tile unit multiplies bytes, and the activation codes are 16-bit. A row of 32 codes is 64 bytes
// as they lie in memory: code i's low byte (unsigned) at 2i, its high byte (signed) at 2i + 1. So the
// A tile is the rows' codes themselves, no copy, and the weights go in twice: B_low holds each code
// in the byte facing an activation's low byte and zero in the one facing its high byte, B_high the
// other way round. C_low = sum(q * lo) takes A as unsigned bytes (its high bytes meet zeros), C_high =
// sum(q * hi) as signed ones, and sum(q * qx) = 256 * C_high + C_low, exact (|256 * C_high| < 2^28).
// Unsigned 4- and 5-bit codes multiply as unsigned bytes (tdpbuud, tdpbsud), Q8_0's and Q6_K's q - 32
// as signed (tdpbusd, tdpbssd). Q6_K's sub-blocks of 16 inputs are units of their own: half-width A
// tiles and half-height B tiles, one scale each, in the vector tiles' order.
//
// B's layout: row p of a group (16 rows of 64 bytes) holds, per column n, the int16 lanes 2n and
// 2n + 1 = the codes at inputs 2p and 2p + 1: exactly what the vector tiles' `unpack` gives for one
// pair of inputs and eight columns, two tiles side by side. Each group's B_low and B_high are built
// once per work item (a column block over a panel of rows) and serve every 16-row block of the panel.
//
// Compiled for AVX-512 and AMX by target attributes on this file's functions only: the rest of the
// extension stays AVX2 code, and nothing here runs unless use_amx().

#include "amx_gemm.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "simd.h"

#define STEPAHEAD_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma,amx-tile,amx-int8")))

namespace stepahead_cpu {

namespace {

// Linux's arch_prctl request for the tile data state (asm/prctl.h, xfeatures): without it the first
// tile instruction faults.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureTileData = 18;

// A warmer's lines per 16-row block: as many as the vector tiles ask for over the same outputs (16
// per four rows by two tiles).
constexpr int kWarmLinesPerBlock = 64;

// One group of 32 inputs of a column block, as the tile unit reads it (see the top of the file). B_high
// is B_low one byte later in memory (each code moves from a lane's low byte to its high byte, and a
// lane's zero high byte fills the next lane's low one): the tile unit loads it from low - 1, the byte
// before `low` zero. Each of those rows straddles two cache lines, but an aligned copy of B_high was
// slower: it doubles the expanded groups' bytes, which then no longer stay in L1 beside the
// activations' tiles (docs/BENCHMARKS.md, section 14.4).
struct ExpandedGroup {
  alignas(64) float scales[16];  // per column: the float16 scale widened, or a k-quant's d * sc
  float mins[16];                // per column: the float16 min widened, or -dmin * m (unused for Q8)
  float second_scales[16];       // Q6_K: d * sc of the group's second sub-block of 16 inputs
  uint8_t zero[64];
  uint8_t low[16 * 64];
};

// One group's integer sums of a 16-row block, as the tile unit stores them: [row][column] int32.
struct GroupSums {
  alignas(64) int32_t low[16 * 16];
  alignas(64) int32_t high[16 * 16];
};

// ldtilecfg's 64 bytes, palette 1: A tiles (0, 5) 16 rows of a unit's inputs (a group of 32, or
// Q6_K's sub-block of 16), B tiles (1, 2) their pairs, C tiles (3, 4, 6, 7) 16 rows of 16 int32.
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int unit_inputs) {
    for (int tile = 0; tile < 8; ++tile) {
      const bool a = tile == 0 || tile == 5, b = tile == 1 || tile == 2;
      bytes_per_row[tile] = a ? 2 * unit_inputs : 64;
      rows[tile] = b ? unit_inputs / 2 : 16;
    }
  }
};

// The formats with an AMX path: kSlots pairs of inputs per int16 lane of kChunks chunks of 32 bytes
// (packed_gemm.cpp's layout), signed codes (Q8_0, Q6_K's q - 32) or unsigned ones with mins, the
// codes' high bits in kHighChunks chunks after the nibbles (Q5_0, Q5_1, Q5_K: one; Q6_K: two), and
// kSubBlocks scales per group (Q6_K: two sub-blocks of 16 inputs, each summed and scaled on its own).
template <PackedWeight::Format Format, int Slots, bool Signed, int HighChunks, int SubBlocks = 1>
struct AmxFormat {
  static constexpr PackedWeight::Format kFormat = Format;
  static constexpr int kSlots = Slots, kChunks = 16 / Slots, kHighChunks = HighChunks, kSubBlocks = SubBlocks;
  static constexpr bool kSigned = Signed, kHasMins = !Signed;
};
using AmxQ4 = AmxFormat<PackedWeight::Format::kQ4, 4, false, 0>;
using AmxQ5 = AmxFormat<PackedWeight::Format::kQ5, 4, false, 1>;
using AmxQ8 = AmxFormat<PackedWeight::Format::kQ8, 2, true, 0>;
using AmxQ4K = AmxFormat<PackedWeight::Format::kQ4K, 4, false, 0>;
using AmxQ5K = AmxFormat<PackedWeight::Format::kQ5K, 4, false, 1>;
using AmxQ6K = AmxFormat<PackedWeight::Format::kQ6K, 4, true, 2, 2>;

// Two tiles' 32-byte chunks as one 64-byte row (columns 0-7, then 8-15); `second` null: zeros.
STEPAHEAD_AMX_TARGET inline __m512i two_chunks(const uint8_t* first, const uint8_t* second) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first));
  const __m256i b = second != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second))
                                      : _mm256_setzero_si256();
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

// The codes of pair kSlots j + s in int16 lanes with zero high bytes (signed codes as their byte).
template <typename F>
STEPAHEAD_AMX_TARGET inline __m512i pair_codes(__m512i chunk, const __m512i* high, int j, int s) {
  const __m512i byte = _mm512_set1_epi16(0x00ff);
  if constexpr (F::kSlots == 2) {  // Q8: slot 0 the low byte, slot 1 the high one
    return s == 0 ? _mm512_and_si512(chunk, byte) : _mm512_srli_epi16(chunk, 8);
  } else {
    const __m512i low = _mm512_and_si512(_mm512_srli_epi16(chunk, 4 * s), _mm512_set1_epi16(0x0f));
    const int b = 4 * j + s;
    if constexpr (F::kHighChunks == 0) {
      return low;
    } else if constexpr (F::kHighChunks == 1) {  // bit b of the lane is the code's bit 4
      const __m512i h = b >= 4 ? _mm512_srli_epi16(high[0], b - 4) : _mm512_slli_epi16(high[0], 4 - b);
      return _mm512_or_si512(low, _mm512_and_si512(h, _mm512_set1_epi16(0x10)));
    } else {  // Q6_K: bits 2 (b % 8) and the next of chunk b / 8 are bits 4 and 5; the code is q - 32
      const int at = 2 * (b % 8);
      const __m512i h = at >= 4 ? _mm512_srli_epi16(high[b / 8], at - 4) : _mm512_slli_epi16(high[b / 8], 4 - at);
      const __m512i q = _mm512_or_si512(low, _mm512_and_si512(h, _mm512_set1_epi16(0x30)));
      return _mm512_and_si512(_mm512_sub_epi16(q, _mm512_set1_epi16(32)), byte);
    }
  }
}

// 8 float16 values widened to float32 (exact) into out[0..8), or zeros where `halves` is null.
STEPAHEAD_AMX_TARGET inline void widen8(const uint8_t* halves, float* out) {
  _mm256_store_ps(out, halves != nullptr ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves)))
                                         : _mm256_setzero_ps());
}

// 8 products float16 factor * byte (a k-quant's d * sc or -dmin * m, exact; Q6_K's bytes signed) into
// out[0..8).
template <bool SignedBytes>
STEPAHEAD_AMX_TARGET inline void kquant_factors8(const uint8_t* halves, const uint8_t* bytes, float* out) {
  if (halves == nullptr) {
    _mm256_store_ps(out, _mm256_setzero_ps());
    return;
  }
  const __m256 factor = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves)));
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  const __m256i values = SignedBytes ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
  _mm256_store_ps(out, _mm256_mul_ps(factor, _mm256_cvtepi32_ps(values)));
}

// The column block's groups in the tile unit's layout, with their scales and mins.
template <typename F>
STEPAHEAD_AMX_TARGET void expand(const PackedWeight& w, int64_t t, int64_t count, ExpandedGroup* out) {
  constexpr PackedWeight::Format kFormat = F::kFormat;
  constexpr int64_t kRecord = record_bytes(kFormat);
  const int64_t groups = w.K / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    ExpandedGroup& e = out[g];
    e.zero[63] = 0;
    const uint8_t* codes[2] = {nullptr, nullptr};  // the group's codes in each tile
    const uint8_t* record[2] = {nullptr, nullptr};
    for (int64_t c = 0; c < count; ++c) {
      if constexpr (is_kquant(kFormat)) {
        const int64_t supers = w.K / kSuperBlock, in_super = g % (kSuperBlock / kGroup);
        record[c] = w.tiles + ((t + c) * supers + g / (kSuperBlock / kGroup)) * kRecord;
        codes[c] = record[c] + kquant_header_bytes(kFormat) + in_super * kquant_group_bytes(kFormat);
      } else {
        record[c] = codes[c] = w.tiles + ((t + c) * groups + g) * kRecord;
      }
    }
    __m512i high[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int h = 0; h < F::kHighChunks; ++h)
      high[h] = two_chunks(codes[0] + 128 + 32 * h, codes[1] ? codes[1] + 128 + 32 * h : nullptr);
#pragma GCC unroll 8
    for (int j = 0; j < F::kChunks; ++j) {
      const __m512i chunk = two_chunks(codes[0] + 32 * j, codes[1] ? codes[1] + 32 * j : nullptr);
#pragma GCC unroll 4
      for (int s = 0; s < F::kSlots; ++s) {
        const __m512i low = pair_codes<F>(chunk, high, j, s);
        const int p = F::kSlots * j + s;
        _mm512_store_si512(e.low + 64 * p, low);
      }
    }
    for (int c = 0; c < 2; ++c) {
      if constexpr (kFormat == PackedWeight::Format::kQ6K) {  // header: d, int8 scales [sub-block][column]
        const int64_t in_super = g % (kSuperBlock / kGroup);
        const uint8_t* r = record[c];
        kquant_factors8<true>(r, r ? r + 16 + (2 * in_super) * 8 : nullptr, e.scales + 8 * c);
        kquant_factors8<true>(r, r ? r + 16 + (2 * in_super + 1) * 8 : nullptr, e.second_scales + 8 * c);
      } else if constexpr (is_kquant(kFormat)) {  // header: d, -dmin, scale bytes [group][column], min bytes
        const int64_t in_super = g % (kSuperBlock / kGroup);
        const uint8_t* r = record[c];
        kquant_factors8<false>(r, r ? r + 32 + in_super * 8 : nullptr, e.scales + 8 * c);
        kquant_factors8<false>(r ? r + 16 : nullptr, r ? r + 32 + 64 + in_super * 8 : nullptr, e.mins + 8 * c);
      } else {
        const uint8_t* halves = record[c] ? record[c] + code_bytes(kFormat) : nullptr;
        widen8(halves, e.scales + 8 * c);
        if constexpr (F::kHasMins) widen8(halves ? halves + 16 : nullptr, e.mins + 8 * c);
      }
    }
  }
}

// Unit U's integer sums on the tile unit (a group of 32 inputs, or a Q6_K sub-block of 16: its rows of
// B_low, and B_high one byte before them): C_LOW and C_HIGH of the block's rows into DST.
#define STEPAHEAD_AMX_GROUP(U, DST, A, C_LOW, C_HIGH)                                             \
  _tile_loadd(A, codes + (U) * kUnitInputs, xq.row_stride * 2);                                   \
  _tile_loadd(1, expanded[(U) / F::kSubBlocks].low + ((U) % F::kSubBlocks) * kUnitRows * 64, 64);     \
  _tile_loadd(2, expanded[(U) / F::kSubBlocks].low + ((U) % F::kSubBlocks) * kUnitRows * 64 - 1, 64); \
  _tile_zero(C_LOW);                                     \
  _tile_zero(C_HIGH);                                    \
  if constexpr (F::kSigned) {                            \
    _tile_dpbusd(C_LOW, A, 1);                           \
    _tile_dpbssd(C_HIGH, A, 2);                          \
  } else {                                               \
    _tile_dpbuud(C_LOW, A, 1);                           \
    _tile_dpbsud(C_HIGH, A, 2);                          \
  }                                                      \
  _tile_stored(C_LOW, (DST).low, 64);                    \
  _tile_stored(C_HIGH, (DST).high, 64);

// The 16 rows of a block, one X(r) each: the accumulators are 16 named variables, because an array of
// them (even indexed only in unrolled loops) stays on the stack, and every group then loads and stores
// each row's accumulator (up to a tenth of a call's time, docs/BENCHMARKS.md, section 14.4).
#define STEPAHEAD_AMX_ROWS(X) \
  X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#define STEPAHEAD_AMX_ZERO(R) __m512 acc##R = _mm512_setzero_ps();
// Row R's sum(q * qx) = 256 * C_high + C_low, scaled into its accumulator.
#define STEPAHEAD_AMX_SCALE(R)                                                                              \
  {                                                                                                        \
    const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c_high + 16 * (R)), 8),      \
                                         _mm512_load_si512(c_low + 16 * (R)));                            \
    acc##R = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scales, _mm512_set1_ps(dx[(R) * x_groups])), \
                             acc##R);                                                                      \
    if constexpr (F::kHasMins) acc##R = _mm512_fmadd_ps(mins, _mm512_set1_ps(dx_sums[(R) * x_groups]), acc##R); \
  }
#define STEPAHEAD_AMX_KEEP(R) _mm512_store_ps(result[R], acc##R);

// Rows row0 .. row0 + 16 by the block's 16 columns, group after group; then as packed_gemm.cpp's store.
// The tile unit computes group g + 1's integer sums (even and odd groups on their own tiles and
// buffers, which stay in L1) while the vector unit scales group g's. Measured, the two overlap little
// (a unit costs about the tile work alone plus the vector work alone, docs/BENCHMARKS.md, section
// 14.4). Two 16-row blocks per pass sharing one load of the B tiles (all eight tiles) were slower: 32
// accumulators do not fit the 32 vector registers.
template <typename F>
STEPAHEAD_AMX_TARGET void rows16(const PackedWeight& w, const QuantizedRows& xq, int64_t row0, int64_t t,
                                 int64_t count, const ExpandedGroup* expanded, const Output& out) {
  constexpr int64_t kUnitInputs = kGroup / F::kSubBlocks, kUnitRows = kUnitInputs / 2;
  const int64_t units = w.K / kUnitInputs, x_groups = xq.row_stride / kGroup;
  const int16_t* codes = xq.codes + row0 * xq.row_stride;
  GroupSums ring[2];
  STEPAHEAD_AMX_ROWS(STEPAHEAD_AMX_ZERO)
  STEPAHEAD_AMX_GROUP(0, ring[0], 0, 3, 4)
  for (int64_t u = 0; u < units; ++u) {
    if (u + 1 < units) {
      if ((u + 1) % 2 == 1) {
        STEPAHEAD_AMX_GROUP(u + 1, ring[1], 5, 6, 7)
      } else {
        STEPAHEAD_AMX_GROUP(u + 1, ring[0], 0, 3, 4)
      }
    }
    // The tile stores are asm without memory operands: unit u's sums are read after its stores, and
    // unit u + 2's stores come after these reads (the ring alone: a clobber of all memory would keep
    // the row pointers below in memory too).
    asm volatile("" : "+m"(ring));
    const int64_t g = u / F::kSubBlocks;
    const int32_t* c_low = ring[u % 2].low;
    const int32_t* c_high = ring[u % 2].high;
    const __m512 scales = _mm512_load_ps(u % F::kSubBlocks == 0 ? expanded[g].scales : expanded[g].second_scales);
    const __m512 mins = _mm512_load_ps(expanded[g].mins);
    const float* dx = xq.scales + row0 * x_groups + g;  // row r's at r * x_groups
    const float* dx_sums = xq.sums + row0 * x_groups + g;
    STEPAHEAD_AMX_ROWS(STEPAHEAD_AMX_SCALE)
    asm volatile("" : "+m"(ring));
  }
  alignas(64) float result[16][16];
  STEPAHEAD_AMX_ROWS(STEPAHEAD_AMX_KEEP)
  const int64_t n0 = t * kTileColumns, columns = std::min(count * kTileColumns, w.N - n0);
  const int64_t stride = out.stride ? out.stride : w.N;
  for (int r = 0; r < 16; ++r) {
    const float* v = result[r];
    float* y = out.y + (row0 + r) * stride + n0;
    for (int64_t i = 0; i < columns; ++i) {
      const float rounded = round_to_bf16(v[i]);
      const float value = w.bias != nullptr ? rounded + w.bias[n0 + i] : rounded;
      y[i] = out.accumulate ? y[i] + value : value;
    }
  }
}

#undef STEPAHEAD_AMX_KEEP
#undef STEPAHEAD_AMX_SCALE
#undef STEPAHEAD_AMX_ZERO
#undef STEPAHEAD_AMX_ROWS
#undef STEPAHEAD_AMX_GROUP

template <typename F>
STEPAHEAD_AMX_TARGET void amx_block(const PackedWeight& w, const QuantizedRows& xq, int64_t M, int64_t t,
                                    int64_t count, const Output& out, Warmer* warmer) {
  thread_local std::vector<ExpandedGroup> expanded;
  const int64_t groups = w.K / kGroup;
  if (static_cast<int64_t>(expanded.size()) < groups) expanded.resize(groups);
  expand<F>(w, t, count, expanded.data());
  // Per call: the thread's tile configuration is its own, and another library (oneDNN) may change it.
  alignas(64) const TileConfig config(kGroup / F::kSubBlocks);
  _tile_loadconfig(&config);
  asm volatile("" ::: "memory");  // the expanded codes stored before the tile loads read them
  for (int64_t row0 = 0; row0 < M; row0 += kAmxRows) {
    if (warmer != nullptr) warmer->step(kWarmLinesPerBlock);
    rows16<F>(w, xq, row0, t, count, expanded.data(), out);
  }
  _tile_release();
}

bool cpu_has_amx_int8() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  const bool amx = (d & (1u << 24)) != 0 && (d & (1u << 25)) != 0;  // AMX-TILE, AMX-INT8
  __builtin_cpu_init();
  return amx && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

}  // namespace

bool use_amx() {
  static const bool amx = [] {
    const char* cap = std::getenv("STEPAHEAD_MAX_CPU_ISA");
    const std::string capped = cap != nullptr ? cap : "";
    if (capped == "avx2" || capped == "avx512_vnni" || capped == "avx512") return false;
    // The permission is the process's (every thread's), asked once.
    return cpu_has_amx_int8() && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) == 0;
  }();
  return amx;
}

AmxBlockFn amx_block_runner(PackedWeight::Format format) {
  if (!use_amx()) return nullptr;
  switch (format) {
    case PackedWeight::Format::kQ4: return amx_block<AmxQ4>;
    case PackedWeight::Format::kQ5: return amx_block<AmxQ5>;
    case PackedWeight::Format::kQ8: return amx_block<AmxQ8>;
    case PackedWeight::Format::kQ4K: return amx_block<AmxQ4K>;
    case PackedWeight::Format::kQ5K: return amx_block<AmxQ5K>;
    case PackedWeight::Format::kQ6K: return amx_block<AmxQ6K>;
  }
  return nullptr;
}

}  // namespace stepahead_cpu
