// y = x @ W^T for W held as GGUF's 4-bit or 8-bit codes and scales (Q4_0, Q4_1, Q8_0), on x86 CPUs
// with AVX2, with integer dot products (as llama.cpp multiplies its Q4 and Q8 codes, but with 16-bit
// activations, not 8-bit).
//
// W is [N, K] in groups of 32 consecutive inputs, each with a float16 scale (and min), in tiles of
// eight columns (packed_gemm.h); Q5_0 / Q5_1's 5-bit codes add a chunk of fifth bits to the 4-bit
// record, and the k-quants (Q4_K, Q5_K, Q6_K) have records per super-block of 256 inputs holding
// llama.cpp's factors (ktile). 4-bit (int4_gemm): w = q * scale + min with codes 0..15. 8-bit
// (int8_gemm, GGUF's Q8_0): w = q * scale with int8 codes. Each row of x is quantized per group of 32 to int16 codes qx
// with one scale dx = max|x| / 32767, so a group's product is
//     sum(w * x) = scale * dx * sum(q * qx) + min * dx * sum(qx)
// Activations are rounded to bfloat16 values before they are quantized (see quantize_row), and
// 15-bit codes keep that precision (8-bit ones, as llama.cpp's, tripled the built-in model's logit
// error against fp32). Outputs are rounded to bfloat16 values, as torch's weight-only kernels round
// theirs.
//
// The vector lanes are output columns: a tile's codes for one pair of inputs are one vector of 16
// int16 (eight columns by two inputs), and vpmaddwd with the pair's two activation codes broadcast
// adds both products into each column's int32 lane. A group's integer sum sum(q * qx) is then exact
// and complete in its lane, converted to float once and scaled once. (Lanes along the inputs, the
// first layout, paid a conversion, a scale and a horizontal sum per column and group: twice the
// instructions per multiply-add.)
//
// Where the CPU has AVX-512 VNNI, one vpdpwssd does a pair's vpmaddwd and vpaddd (still on 256-bit
// vectors): more multiply-adds per cycle on Zen 4, where the adds had competed with the unpacking for
// the vector pipes (docs/BENCHMARKS.md, section 14.4). The sums are exact either way, so both paths give the same bits
// (MaddAdd, Vnni; STEPAHEAD_MAX_CPU_ISA=avx2 keeps the first). Where the CPU also has AVX-512 F and BW,
// blocks of two tiles go to packed_gemm_zmm.cpp's tiles on 512-bit vectors (both tiles per vector, up
// to eight rows a pass), the same bits again; STEPAHEAD_MAX_CPU_ISA=avx512_vnni keeps these.
//
// A row's result does not depend on its batch: its quantization uses its own values only, the integer
// sums are exact, and the float accumulation over groups always runs in the same order, whatever the
// number of rows and wherever the row sits, and whichever thread computes it. Rows are taken four at a
// time by two tiles, so the unpacked codes of a pair are reused from registers by four rows and each
// broadcast activation pair by sixteen columns (the last one to three rows two tiles at a time too,
// so a one-row call keeps enough loads in flight), and a work item is a block of columns whose codes
// and four rows of activations stay in L1, over a panel of rows whose codes stay in L2 (a 2,048-token
// prefill read every row's codes from L3 once per 16 columns without panels, and was slower).

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "amx_gemm.h"
#include "ops.h"
#include "packed_codes.h"
#include "packed_gemm.h"
#include "simd.h"
#include "team.h"

namespace stepahead_cpu {

namespace {

constexpr float kCodeMax = 32767.f;

// Bytes of activation codes per panel of rows (multiply): half of the build machine's L2 per core.
constexpr int64_t kPanelBytes = 256 * 1024;

// How a pair's products join a group's int32 sums: sum + (w0 * x0 + w1 * x1) per column lane, exact
// (no lane reaches 2^31: a group's 32 products of codes under 2^8 and 2^15).
struct MaddAdd {  // any AVX2 CPU: vpmaddwd, then vpaddd
  static __m256i add_products(__m256i sum, __m256i w, __m256i x) {
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(w, x));
    // Keeps the sum in its register: GCC otherwise reassociates a group's adds into a tree and spills
    // every product to the stack (four-row tiles measurably slower).
    asm("" : "+x"(sum));
    return sum;
  }
};

struct Vnni {  // AVX-512 VNNI and VL: one vpdpwssd
  static __m256i add_products(__m256i sum, __m256i w, __m256i x) {
    // asm, not the intrinsic: the intrinsic needs its function compiled for AVX-512, which would let GCC
    // use AVX-512 in the tile function itself, and the AVX2 path must not. {evex}: AVX-512's encoding
    // (the VEX one is AVX-VNNI, which Zen 4 lacks).
    asm("%{evex%} vpdpwssd %2, %1, %0" : "+x"(sum) : "x"(w), "x"(x));
    return sum;
  }
};

// What this process multiplies with, decided once (it cannot change while a process runs): the widest
// the CPU (and its OS) has, capped by STEPAHEAD_MAX_CPU_ISA ("avx2" or "avx512_vnni"). kVnni: AVX-512
// VNNI and VL, vpdpwssd on 256-bit vectors; kZmm: also AVX-512 F and BW, two tiles per 512-bit vector
// (packed_gemm_zmm.cpp). Every level gives the same bits.
enum class Isa { kAvx2, kVnni, kZmm };

Isa isa() {
  static const Isa chosen = [] {
    const char* cap_env = std::getenv("STEPAHEAD_MAX_CPU_ISA");
    const std::string cap = cap_env != nullptr ? cap_env : "";
    __builtin_cpu_init();
    const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
    const bool zmm = vnni && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     zmm_block_runner(PackedWeight::Format::kQ4) != nullptr;
    if (cap == "avx2" || !vnni) return Isa::kAvx2;
    if (cap == "avx512_vnni" || !zmm) return Isa::kVnni;
    return Isa::kZmm;
  }();
  return chosen;
}

// y[row .. row + R) x the columns of tiles t .. t + C (eight each, lanes = columns). Per group, the
// integer sums sum(q * qx) of each (row, column) build up in int32 lanes (exact: under 2^31; for 4-bit
// codes under 2^24, so the conversion to float is exact too), then go into the float sums as
// sum * (scale * dx), plus min * dx * sum(qx) for 4-bit codes, group after group (the float16 scales
// and mins converted to float32 exactly); A adds each pair's products (MaddAdd, Vnni). Not inlined:
// each shape gets its own register allocation (inlined into multiply, four-row tiles were slower).
template <typename F, typename A, int R, int C>
__attribute__((noinline)) void tile(const QuantizedRows& xq, int64_t row, const PackedWeight& w, const Output& out,
                                    int64_t t) {
  constexpr int64_t kRecord = record_bytes(F::kFormat), kCodeBytes = code_bytes(F::kFormat);
  const int64_t groups = w.K / kGroup, x_groups = xq.row_stride / kGroup;
  const uint8_t* tiles = w.tiles + t * groups * kRecord;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  // A call of one to three rows streams the weights once, and the hardware prefetchers alone keep
  // too few lines in flight to read them at memory speed (they stop at each 4 KB page): ask for the
  // records kPrefetchGroups ahead. Four-row tiles are bound by arithmetic instead, and the tail rows
  // of a larger call find their records in cache.
  const bool prefetch = R < 4 && row == 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int16_t* qx = xq.codes + row * xq.row_stride + g * kGroup;
    if (prefetch) {
      for (int c = 0; c < C; ++c) {
        const uint8_t* ahead = tiles + (c * groups + g + kPrefetchGroups) * kRecord;
        for (int64_t b = 0; b < kRecord; b += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + b), _MM_HINT_T0);
      }
    }
    __m256i sums[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sums[r][c] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < F::kChunks; ++j) {
      __m256i chunk[C], high[C];
      for (int c = 0; c < C; ++c) {
        const uint8_t* codes = tiles + (c * groups + g) * kRecord;
        chunk[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * j));
        high[c] = F::kHigh ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * F::kChunks))
                           : _mm256_setzero_si256();
      }
#pragma GCC unroll 4
      for (int s = 0; s < F::kSlots; ++s) {
        __m256i w[C];
        for (int c = 0; c < C; ++c) w[c] = F::code(chunk[c], high[c], j, s);
        for (int r = 0; r < R; ++r) {
          int32_t pair;  // the activation codes of inputs 2 * (kSlots * j + s) and the next
          std::memcpy(&pair, qx + r * xq.row_stride + 2 * (F::kSlots * j + s), sizeof(pair));
          const __m256i x = _mm256_set1_epi32(pair);
          for (int c = 0; c < C; ++c) sums[r][c] = A::add_products(sums[r][c], w[c], x);
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const uint8_t* halves = tiles + (c * groups + g) * kRecord + kCodeBytes;  // scales, then mins
      const __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves)));
      __m256 mins = _mm256_setzero_ps();
      if constexpr (F::kHasMins) mins = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + 16)));
      for (int r = 0; r < R; ++r) {
        const int64_t x_group = (row + r) * x_groups + g;
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][c]),
                                    _mm256_mul_ps(scales, _mm256_set1_ps(xq.scales[x_group])), acc[r][c]);
        if constexpr (F::kHasMins) acc[r][c] = _mm256_fmadd_ps(mins, _mm256_set1_ps(xq.sums[x_group]), acc[r][c]);
      }
    }
  }
  store<R, C>(acc, row, w, out, t);
}

// tile for the k-quants: the same sums per pair of inputs, over records of a super-block. Per group of
// 32 (Q6_K: per sub-block of 16) the int32 sums are exact (under 2^31: 32 products of codes under 2^5
// and 2^15, or 16 under 2^6) and go into the float sums as sum * ((d * sc) * dx), then Q4_K / Q5_K's
// (-dmin * m) * dx * sum(qx), group after group; d * sc and dmin * m are exact in float32.
template <typename F, typename A, int R, int C>
__attribute__((noinline)) void ktile(const QuantizedRows& xq, int64_t row, const PackedWeight& w, const Output& out,
                                     int64_t t) {
  constexpr int64_t kRecord = record_bytes(F::kFormat), kHeader = kquant_header_bytes(F::kFormat);
  constexpr int64_t kGroupBytes = kquant_group_bytes(F::kFormat), kGroups = kSuperBlock / kGroup;
  constexpr int kChunksPerSub = (kGroup / 2 / 4) / F::kSubBlocks;  // nibble chunks per sub-block
  const int64_t supers = w.K / kSuperBlock, x_groups = xq.row_stride / kGroup;
  const uint8_t* tiles = w.tiles + t * supers * kRecord;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const bool prefetch = R < 4 && row == 0;  // as tile's, about as many bytes ahead as its 4-bit records
  constexpr int64_t kPrefetchSupers =
      (kPrefetchGroups * record_bytes(PackedWeight::Format::kQ4) + kRecord - 1) / kRecord;
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* record[C];
    __m256 d[C], neg_dmin[C];
    for (int c = 0; c < C; ++c) {
      record[c] = tiles + (c * supers + sb) * kRecord;
      if (prefetch) {
        const uint8_t* ahead = record[c] + kPrefetchSupers * kRecord;
        for (int64_t b = 0; b < kRecord; b += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + b), _MM_HINT_T0);
      }
      d[c] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(record[c])));
      if constexpr (F::kHasMins)
        neg_dmin[c] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(record[c] + 16)));
    }
    constexpr int64_t kScalesAt = F::kHasMins ? 32 : 16;
    for (int64_t g = 0; g < kGroups; ++g) {
      const int64_t x_group = sb * kGroups + g;
      const int16_t* qx = xq.codes + row * xq.row_stride + x_group * kGroup;
#pragma GCC unroll 2
      for (int sub = 0; sub < F::kSubBlocks; ++sub) {
        __m256i sums[R][C];
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) sums[r][c] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int jj = 0; jj < kChunksPerSub; ++jj) {
          const int j = sub * kChunksPerSub + jj;
          __m256i chunk[C], high[C][F::kHighChunks > 0 ? F::kHighChunks : 1];
          for (int c = 0; c < C; ++c) {
            const uint8_t* group = record[c] + kHeader + g * kGroupBytes;
            chunk[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 32 * j));
            for (int h = 0; h < F::kHighChunks; ++h)
              high[c][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 128 + 32 * h));
          }
#pragma GCC unroll 4
          for (int s = 0; s < 4; ++s) {
            __m256i wc[C];
            for (int c = 0; c < C; ++c) wc[c] = F::code(chunk[c], high[c], j, s);
            for (int r = 0; r < R; ++r) {
              int32_t pair;
              std::memcpy(&pair, qx + r * xq.row_stride + 2 * (4 * j + s), sizeof(pair));
              const __m256i x = _mm256_set1_epi32(pair);
              for (int c = 0; c < C; ++c) sums[r][c] = A::add_products(sums[r][c], wc[c], x);
            }
          }
        }
        for (int c = 0; c < C; ++c) {
          const __m128i bytes =
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(record[c] + kScalesAt + (g * F::kSubBlocks + sub) * 8));
          const __m256i sc = F::kSignedScales ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
          const __m256 scale = _mm256_mul_ps(d[c], _mm256_cvtepi32_ps(sc));  // exact
          for (int r = 0; r < R; ++r)
            acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][c]),
                                        _mm256_mul_ps(scale, _mm256_set1_ps(xq.scales[(row + r) * x_groups + x_group])),
                                        acc[r][c]);
        }
      }
      if constexpr (F::kHasMins) {
        for (int c = 0; c < C; ++c) {
          const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(record[c] + 32 + 64 + g * 8));
          const __m256 mins = _mm256_mul_ps(neg_dmin[c], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));  // exact
          for (int r = 0; r < R; ++r)
            acc[r][c] = _mm256_fmadd_ps(mins, _mm256_set1_ps(xq.sums[(row + r) * x_groups + x_group]), acc[r][c]);
        }
      }
    }
  }
  store<R, C>(acc, row, w, out, t);
}

template <typename F, typename A, int R, int C>
constexpr TileFn tile_for() {
  if constexpr (F::kSuper) return ktile<F, A, R, C>;
  else return tile<F, A, R, C>;
}

// y[:, columns of tiles t .. t + count): four rows by two tiles where there are four rows (by one
// tile, a little slower, for an odd block's last tile), then the last one to three rows by two tiles
// (more loads in flight for a one-row step).
template <typename F, typename A>
void block_of(const PackedWeight& w, const QuantizedRows& xq, int64_t M, int64_t t, int64_t count,
              const Output& out, Warmer* warmer) {
  const auto warm = [&] {
    if (warmer != nullptr) warmer->step(kWarmLinesPerTile);
  };
  constexpr TileFn two_tiles[4] = {nullptr, tile_for<F, A, 1, 2>(), tile_for<F, A, 2, 2>(), tile_for<F, A, 3, 2>()};
  constexpr TileFn one_tile[4] = {nullptr, tile_for<F, A, 1, 1>(), tile_for<F, A, 2, 1>(), tile_for<F, A, 3, 1>()};
  constexpr TileFn four_rows_two = tile_for<F, A, 4, 2>(), four_rows_one = tile_for<F, A, 4, 1>();
  int64_t row = 0;
  for (; row + 4 <= M; row += 4) {
    int64_t i = 0;
    for (; i + 2 <= count; i += 2) warm(), four_rows_two(xq, row, w, out, t + i);
    if (i < count) warm(), four_rows_one(xq, row, w, out, t + i);
  }
  if (row == M) return;
  int64_t i = 0;
  for (; i + 2 <= count; i += 2) warm(), two_tiles[M - row](xq, row, w, out, t + i);
  if (i < count) warm(), one_tile[M - row](xq, row, w, out, t + i);
}

template <typename A>
BlockFn block_runner_for(PackedWeight::Format format) {
  switch (format) {
    case PackedWeight::Format::kQ4: return block_of<Q4, A>;
    case PackedWeight::Format::kQ8: return block_of<Q8, A>;
    case PackedWeight::Format::kQ5: return block_of<Q5, A>;
    case PackedWeight::Format::kQ4K: return block_of<Q4K, A>;
    case PackedWeight::Format::kQ5K: return block_of<Q5K, A>;
    case PackedWeight::Format::kQ6K: return block_of<Q6K, A>;
  }
  TORCH_CHECK(false, "unknown packed weight format");
}

// A work item's function for blocks of two tiles (pairs) and for an odd block's last tile (single).
struct BlockRunners {
  BlockFn pairs, single;
};

BlockRunners block_runners(PackedWeight::Format format, Isa level) {
  switch (level) {
    case Isa::kAvx2: return {block_runner_for<MaddAdd>(format), block_runner_for<MaddAdd>(format)};
    case Isa::kVnni: return {block_runner_for<Vnni>(format), block_runner_for<Vnni>(format)};
    case Isa::kZmm: return {zmm_block_runner(format), block_runner_for<Vnni>(format)};
  }
  TORCH_CHECK(false, "unknown instruction set");
}

// y = x W^T: the rows quantized, then the column blocks, shared by the threads of one region.
at::Tensor gemm(const at::Tensor& x, const PackedWeight& w) {
  const int64_t M = x.size(0), K = x.size(1);
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  std::vector<int16_t> codes(M * K);
  std::vector<float> scales(M * K / kGroup), sums(M * K / kGroup);
  const QuantizedRows xq{codes.data(), scales.data(), sums.data(), K};
  at::Tensor y = at::empty({M, w.N}, x.options());
  const Output out{y.data_ptr<float>(), false};
  run_in_team(at::get_num_threads(), [&](Team::Member& me) {
    me.share(M, 1, [&](int64_t r) { quantize_row(xp + r * K, K, xq, r); });
    multiply(me, w, xq, M, out);
  });
  return y;
}

// The format whose records are this many bytes (each format's differ).
PackedWeight::Format format_of_record(int64_t bytes) {
  using F = PackedWeight::Format;
  for (const F format : {F::kQ4, F::kQ8, F::kQ5, F::kQ4K, F::kQ5K, F::kQ6K})
    if (record_bytes(format) == bytes) return format;
  TORCH_CHECK(false, "no packed weight format has records of ", bytes, " bytes (packed_gemm.h)");
}

void check_tiles(const at::Tensor& tiles, PackedWeight::Format format, int64_t N, int64_t K) {
  const int64_t inputs = record_inputs(format);
  TORCH_CHECK(K % inputs == 0, "the inputs must be a multiple of ", inputs, ", got ", K);
  const int64_t tile_count = (N + kTileColumns - 1) / kTileColumns;
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
                  tiles.sizes() == at::IntArrayRef({tile_count, K / inputs, record_bytes(format)}),
              "tiles must be a contiguous uint8 [", tile_count, ", ", K / inputs, ", ", record_bytes(format),
              "] tensor (packed_gemm.h)");
}

}  // namespace

// Each value is rounded to bfloat16 first, as torch's kernels round theirs: a last-bit difference in an
// activation (attention computed over another chunking of the same prompt, say) then almost never
// reaches the codes, which 16-bit codes of the float32 value would pass on about once in 500 values.
// A group's 32 values are four vectors: the rounding, |x|'s maximum, the codes (x * (32767 / max)
// rounded to nearest even, as std::nearbyint) and their integer sum are each exact or order-free, so
// the vectors give the scalar loop's results bit for bit.
void quantize_row(const float* x, int64_t K, const QuantizedRows& q, int64_t row) {
  const int64_t groups = K / kGroup;
  int16_t* codes = q.codes + row * q.row_stride;
  float* scales = q.scales + row * (q.row_stride / kGroup);
  float* sums = q.sums + row * (q.row_stride / kGroup);
  const __m256 sign = _mm256_set1_ps(-0.f), infinity = _mm256_set1_ps(INFINITY);
  for (int64_t i = 0; i < groups; ++i) {
    __m256 v[kGroup / 8];
    __m256 amax = _mm256_setzero_ps(), non_finite = _mm256_setzero_ps();
    for (int k = 0; k < kGroup / 8; ++k) {
      v[k] = round_to_bf16(_mm256_loadu_ps(x + i * kGroup + 8 * k));
      const __m256 magnitude = _mm256_andnot_ps(sign, v[k]);
      amax = _mm256_max_ps(amax, magnitude);
      non_finite = _mm256_or_ps(non_finite, _mm256_cmp_ps(magnitude, infinity, _CMP_NLT_UQ));  // inf, NaN
    }
    if (_mm256_movemask_ps(non_finite) != 0) {  // codes 0 and a NaN scale: the row's outputs come out NaN
      std::fill_n(codes + i * kGroup, kGroup, int16_t{0});
      scales[i] = sums[i] = std::nanf("");
      continue;
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    const float d = top / kCodeMax, inv = top > 0.f ? kCodeMax / top : 0.f;
    __m256i total = _mm256_setzero_si256();
    for (int k = 0; k < kGroup / 8; k += 2) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(inv)));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[k + 1], _mm256_set1_ps(inv)));
      total = _mm256_add_epi32(total, _mm256_add_epi32(a, b));
      // packs interleaves the 128-bit halves (a0-3 b0-3 a4-7 b4-7); the permute puts them back in order
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i * kGroup + 8 * k), packed);
    }
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    scales[i] = d;
    sums[i] = d * static_cast<float>(_mm_cvtsi128_si32(t));
  }
}

void multiply(Team::Member& me, const PackedWeight& w, const QuantizedRows& x, int64_t M, const Output& out,
              Warmer* warmer) {
  constexpr int64_t kTilesPerBlock = kColumnBlock / kTileColumns;
  const int64_t tiles = (w.N + kTileColumns - 1) / kTileColumns, blocks = (tiles + kTilesPerBlock - 1) / kTilesPerBlock;
  // Rows in panels whose activation codes stay in L2 while every column block passes over them (one
  // panel for a decode step's few rows).
  int64_t panel = std::max<int64_t>(4, kPanelBytes / (2 * w.K) / 4 * 4);
  // Whole blocks of 16 rows on AMX where this process uses it (amx_gemm.h, the same bits), the rest
  // on the vector tiles; panels of whole AMX blocks.
  const AmxBlockFn amx = amx_block_runner(w.format);
  if (amx != nullptr) panel = std::max<int64_t>(kAmxRows, panel / kAmxRows * kAmxRows);
  const int64_t panels = (M + panel - 1) / panel, items = panels * blocks;
  const BlockRunners runners = block_runners(w.format, isa());
  const int64_t stride = out.stride ? out.stride : w.N;
  const auto rows_from = [&](int64_t first) {
    return QuantizedRows{x.codes + first * x.row_stride, x.scales + first * (x.row_stride / kGroup),
                         x.sums + first * (x.row_stride / kGroup), x.row_stride};
  };
  me.share(items, claim_size(items, me.members()), [&](int64_t item) {
    const int64_t first = item / blocks * panel, block = item % blocks;
    const int64_t t = block * kTilesPerBlock, count = std::min(kTilesPerBlock, tiles - t);
    const int64_t rows = std::min(panel, M - first), amx_rows = amx != nullptr && rows >= kAmxMinRows ? rows / kAmxRows * kAmxRows : 0;
    if (amx_rows > 0)
      amx(w, rows_from(first), amx_rows, t, count, Output{out.y + first * stride, out.accumulate, stride}, warmer);
    const int64_t rest = first + amx_rows;
    const BlockFn run = count == kTilesPerBlock ? runners.pairs : runners.single;
    if (rest < first + rows)
      run(w, rows_from(rest), first + rows - rest, t, count, Output{out.y + rest * stride, out.accumulate, stride},
          warmer);
  });
}

int64_t packed_inputs(const at::Tensor& tiles) {
  TORCH_CHECK(tiles.dim() == 3, "tiles must be a 3-D tensor (packed_gemm.h)");
  return tiles.size(1) * record_inputs(format_of_record(tiles.size(2)));
}

PackedWeight packed_weight(const at::Tensor& tiles, const at::Tensor& bias, int64_t N, int64_t K) {
  TORCH_CHECK(tiles.dim() == 3, "tiles must be a 3-D tensor (packed_gemm.h)");
  const PackedWeight::Format format = format_of_record(tiles.size(2));
  check_tiles(tiles, format, N, K);
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == N),
              "the bias must be a contiguous float32 [", N, "] tensor");
  return PackedWeight{format, tiles.data_ptr<uint8_t>(), bias.defined() ? bias.data_ptr<float>() : nullptr, N, K};
}

PackedParts packed_parts(const std::vector<at::Tensor>& tiles, const at::Tensor& bias, int64_t N, int64_t K) {
  TORCH_CHECK(!tiles.empty(), "a projection needs at least one part");
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == N),
              "the bias must be a contiguous float32 [", N, "] tensor");
  PackedParts out{{}, {}, N};
  int64_t offset = 0;
  for (size_t i = 0; i < tiles.size(); ++i) {
    TORCH_CHECK(tiles[i].dim() == 3, "tiles must be 3-D tensors (packed_gemm.h)");
    const int64_t columns = i + 1 < tiles.size() ? tiles[i].size(0) * kTileColumns : N - offset;
    TORCH_CHECK(columns > 0, "the parts' tiles hold more columns than the projection's ", N);
    PackedWeight part = packed_weight(tiles[i], at::Tensor(), columns, K);
    part.bias = bias.defined() ? bias.data_ptr<float>() + offset : nullptr;
    out.parts.push_back(part);
    out.offsets.push_back(offset);
    offset += columns;
  }
  return out;
}

std::string packed_gemm_isa() {
  if (use_amx()) return "amx_int8";
  switch (isa()) {
    case Isa::kAvx2: return "avx2";
    case Isa::kVnni: return "avx512_vnni";
    case Isa::kZmm: return "avx512";
  }
  TORCH_CHECK(false, "unknown instruction set");
}

at::Tensor packed_gemm(const at::Tensor& x, const at::Tensor& tiles, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  return gemm(x, packed_weight(tiles, at::Tensor(), N, x.size(1)));
}

}  // namespace stepahead_cpu
