// y = x @ W^T for W held as 4-bit or 8-bit codes in GGUF's block layouts, on x86 CPUs with AVX2, with
// integer dot products (as llama.cpp multiplies its Q4 and Q8 codes, but with 16-bit activations, not
// 8-bit).
//
// W is [N, K] in groups of 32 consecutive inputs, each with a float32 scale, in tiles of four columns
// (packed_gemm.h). 4-bit (int4_gemm): w = q * scale + min with codes 0..15 and mins [N, K / 32]. 8-bit
// (int8_gemm, GGUF's Q8_0): w = q * scale with int8 codes. Each row of x is quantized per group of 32
// to int16 codes qx with one scale dx = max|x| / 32767, so a group's product is
//     sum(w * x) = scale * dx * sum(q * qx) + min * dx * sum(qx)
// where sum(q * qx) is exact in int32 (vpmaddwd) and in float (each lane's sum stays under 2^24).
// Activations are rounded to bfloat16 values before they are quantized (see quantize_row), and
// 15-bit codes keep that precision (8-bit ones, as llama.cpp's, tripled the built-in model's logit
// error against fp32). Outputs are rounded to bfloat16 values, as torch's weight-only kernels round
// theirs.
//
// A row's result does not depend on its batch: its quantization uses its own values only, the integer
// sums are exact, and the float accumulation over groups always runs in the same order, whatever the
// number of rows and wherever the row sits, and whichever thread computes it. Rows are taken four at a
// time so the unpacked codes of a group are reused from registers (the last one to three rows four
// columns at a time, so a one-row call keeps enough loads in flight), and a work item is a block of
// columns whose codes and four rows of activations stay in L1.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "packed_gemm.h"
#include "simd.h"
#include "team.h"

namespace stepahead_cpu {

namespace {

inline float round_to_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u) return v;  // inf and nan stay as they are
  bits += 0x7fffu + ((bits >> 16) & 1u);                // round to nearest, ties to even
  bits &= 0xffff0000u;
  std::memcpy(&v, &bits, sizeof(bits));
  return v;
}

constexpr float kCodeMax = 32767.f;

// The weight formats, each a group of 32 codes unpacked as two vectors of 16 int16 (elements 0..15
// and 16..31). Q4: 16 bytes of nibbles (element j low, j + 16 high), w = q * scale + min. Q8 (GGUF's
// Q8_0 blocks): 32 signed bytes, w = q * scale; |q| <= 128 keeps a group's int32 lanes, four products
// each, under 4 * 128 * 32767 < 2^24, so still exact in float.
struct Q4 {
  static constexpr PackedWeight::Format kFormat = PackedWeight::Format::kQ4;
  static constexpr int64_t kGroupBytes = kGroup / 2;
  static constexpr bool kHasMins = true;
  static void unpack(const uint8_t* codes, __m256i& lo, __m256i& hi) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i mask = _mm_set1_epi8(0x0f);
    lo = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
    hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
  }
};

struct Q8 {
  static constexpr PackedWeight::Format kFormat = PackedWeight::Format::kQ8;
  static constexpr int64_t kGroupBytes = kGroup;
  static constexpr bool kHasMins = false;
  static void unpack(const uint8_t* codes, __m256i& lo, __m256i& hi) {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)));
  }
};

// sum(q * qx) over a group as 8 int32 lanes converted to float (exact: |sum| < 2^24).
inline __m256 group_dot(__m256i w_lo, __m256i w_hi, const int16_t* qx) {
  const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
  const __m256i x_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 16));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(w_lo, x_lo), _mm256_madd_epi16(w_hi, x_hi)));
}

// y[row .. row + R) x [n .. n + C), C dividing four and n a multiple of C: columns of one tile.
template <typename F, int R, int C>
void tile(const QuantizedRows& xq, int64_t row, const PackedWeight& w, const Output& out, int64_t n) {
  constexpr int64_t kRecord = record_bytes(F::kFormat), kScales = kTileColumns * F::kGroupBytes;
  const int64_t K = w.K, groups = K / kGroup, x_groups = xq.row_stride / kGroup;
  const uint8_t* records = w.tiles + (n / kTileColumns) * groups * kRecord;
  const int64_t first = n % kTileColumns;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = records + g * kRecord;
    const float* scales = reinterpret_cast<const float*>(record + kScales);
    __m256i w_lo[C], w_hi[C];
    __m256 wscale[C];
    for (int c = 0; c < C; ++c) {
      F::unpack(record + (first + c) * F::kGroupBytes, w_lo[c], w_hi[c]);
      wscale[c] = _mm256_set1_ps(scales[first + c]);
    }
    for (int r = 0; r < R; ++r) {
      const int16_t* qx = xq.codes + (row + r) * xq.row_stride + g * kGroup;
      const __m256 dx = _mm256_set1_ps(xq.scales[(row + r) * x_groups + g]);
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm256_fmadd_ps(group_dot(w_lo[c], w_hi[c], qx), _mm256_mul_ps(wscale[c], dx), acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* sums = xq.sums + (row + r) * x_groups;
    for (int c = 0; c < C; ++c) {
      const float offset = F::kHasMins ? dot(w.mins + (n + c) * groups, sums, groups) : 0.f;
      float v = round_to_bf16(sum_lanes(acc[r][c]) + offset);
      if (w.bias != nullptr) v = v + w.bias[n + c];
      float& y = out.y[(row + r) * w.N + n + c];
      y = out.accumulate ? y + v : v;
    }
  }
}

using TileFn = void (*)(const QuantizedRows&, int64_t, const PackedWeight&, const Output&, int64_t);

// y[:, n .. n + columns) for one block of columns: four rows by two columns where there are four
// rows, then the last rows.
template <typename F>
void block_of(const PackedWeight& w, const QuantizedRows& xq, int64_t M, int64_t n, int64_t columns,
              const Output& out) {
  constexpr TileFn few_rows_four_columns[4] = {nullptr, tile<F, 1, 4>, tile<F, 2, 4>, tile<F, 3, 4>};
  constexpr TileFn few_rows[4] = {nullptr, tile<F, 1, 2>, tile<F, 2, 2>, tile<F, 3, 2>};
  constexpr TileFn few_rows_one_column[4] = {nullptr, tile<F, 1, 1>, tile<F, 2, 1>, tile<F, 3, 1>};
  int64_t row = 0;
  for (; row + 4 <= M; row += 4) {
    int64_t c = 0;
    for (; c + 2 <= columns; c += 2) tile<F, 4, 2>(xq, row, w, out, n + c);
    if (c < columns) tile<F, 4, 1>(xq, row, w, out, n + c);
  }
  if (row == M) return;
  int64_t c = 0;
  for (; c + 4 <= columns; c += 4) few_rows_four_columns[M - row](xq, row, w, out, n + c);
  for (; c + 2 <= columns; c += 2) few_rows[M - row](xq, row, w, out, n + c);
  if (c < columns) few_rows_one_column[M - row](xq, row, w, out, n + c);
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

void check_tiles(const at::Tensor& tiles, PackedWeight::Format format, int64_t N, int64_t K) {
  TORCH_CHECK(K % kGroup == 0, "the inputs must be a multiple of 32, got ", K);
  const int64_t tile_count = (N + kTileColumns - 1) / kTileColumns;
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
                  tiles.sizes() == at::IntArrayRef({tile_count, K / kGroup, record_bytes(format)}),
              "tiles must be a contiguous uint8 [", tile_count, ", ", K / kGroup, ", ", record_bytes(format),
              "] tensor (packed_gemm.h)");
}

}  // namespace

// Each value is rounded to bfloat16 first, as torch's kernels round theirs: a last-bit difference in an
// activation (attention computed over another chunking of the same prompt, say) then almost never
// reaches the codes, which 16-bit codes of the float32 value would pass on about once in 500 values.
void quantize_row(const float* x, int64_t K, const QuantizedRows& q, int64_t row) {
  const int64_t groups = K / kGroup;
  int16_t* codes = q.codes + row * q.row_stride;
  float* scales = q.scales + row * (q.row_stride / kGroup);
  float* sums = q.sums + row * (q.row_stride / kGroup);
  for (int64_t i = 0; i < groups; ++i) {
    float xg[kGroup];
    for (int64_t j = 0; j < kGroup; ++j) xg[j] = round_to_bf16(x[i * kGroup + j]);
    float amax = 0.f;
    bool finite = true;
    for (int64_t j = 0; j < kGroup; ++j) {
      amax = std::max(amax, std::fabs(xg[j]));
      finite = finite && std::isfinite(xg[j]);
    }
    if (!finite) {  // codes 0 and a NaN scale: the row's outputs come out NaN, never finite garbage
      std::fill_n(codes + i * kGroup, kGroup, int16_t{0});
      scales[i] = sums[i] = std::nanf("");
      continue;
    }
    const float d = amax / kCodeMax, inv = amax > 0.f ? kCodeMax / amax : 0.f;
    int32_t total = 0;
    for (int64_t j = 0; j < kGroup; ++j) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xg[j] * inv));
      codes[i * kGroup + j] = static_cast<int16_t>(v);
      total += v;
    }
    scales[i] = d;
    sums[i] = d * static_cast<float>(total);
  }
}

void multiply(Team::Member& me, const PackedWeight& w, const QuantizedRows& x, int64_t M, const Output& out) {
  const int64_t blocks = (w.N + kColumnBlock - 1) / kColumnBlock;
  me.share(blocks, claim_size(blocks, me.members()), [&](int64_t block) {
    const int64_t n = block * kColumnBlock, columns = std::min(kColumnBlock, w.N - n);
    if (w.format == PackedWeight::Format::kQ4) {
      block_of<Q4>(w, x, M, n, columns, out);
    } else {
      block_of<Q8>(w, x, M, n, columns, out);
    }
  });
}

PackedWeight q4_weight(const at::Tensor& tiles, const at::Tensor& mins, const at::Tensor& bias, int64_t N, int64_t K) {
  check_tiles(tiles, PackedWeight::Format::kQ4, N, K);
  TORCH_CHECK(mins.scalar_type() == at::kFloat && mins.is_contiguous() &&
                  mins.sizes() == at::IntArrayRef({N, K / kGroup}),
              "mins must be a contiguous float32 [", N, ", ", K / kGroup, "] tensor");
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == N),
              "the bias must be a contiguous float32 [", N, "] tensor");
  return PackedWeight{PackedWeight::Format::kQ4, tiles.data_ptr<uint8_t>(), mins.data_ptr<float>(),
                      bias.defined() ? bias.data_ptr<float>() : nullptr, N, K};
}

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(mins.dim() == 2, "mins must be a [N, K / 32] tensor");
  return gemm(x, q4_weight(tiles, mins, at::Tensor(), mins.size(0), x.size(1)));
}

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& tiles, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  const int64_t K = x.size(1);
  check_tiles(tiles, PackedWeight::Format::kQ8, N, K);
  return gemm(x, PackedWeight{PackedWeight::Format::kQ8, tiles.data_ptr<uint8_t>(), nullptr, nullptr, N, K});
}

}  // namespace stepahead_cpu
