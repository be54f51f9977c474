// The packed GEMM's pieces (packed_gemm.cpp), for callers that split its work themselves (DecodeStack).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "team.h"
#include "warmer.h"

namespace stepahead_cpu {

constexpr int64_t kGroup = 32;        // inputs per weight scale and per activation scale
constexpr int64_t kColumnBlock = 16;  // output columns one work item computes

// Rows of activations as the kernels read them: per row of K inputs, K int16 codes and K / 32 scales
// dx and offsets dx * sum(codes). Buffers owned by the caller, rows `row_stride` codes apart.
struct QuantizedRows {
  int16_t* codes;
  float* scales;
  float* sums;
  int64_t row_stride;  // codes per row; scales and sums take row_stride / 32 per row
};

// Row `row` of x (K floats, K a multiple of 32) into q.
void quantize_row(const float* x, int64_t K, const QuantizedRows& q, int64_t row);

// W [N, K] as GGUF's 4-bit codes with scales and mins (Q4_1's values) or 8-bit codes with scales
// (Q8_0's), laid out in tiles of eight columns: for each tile, for each group of 32 inputs, one record
// of the eight columns' codes, interleaved so that each 32-byte chunk holds the codes of four (Q4) or
// two (Q8) pairs of inputs for all eight columns (packed_gemm.cpp, Q4 and Q8), followed by their eight
// float16 scales and, for Q4, their eight float16 mins (GGUF stores both as float16, so nothing is
// rounded). Records and tiles follow each other, so a thread reads its columns as one sequential
// stream (a one-row step reads weights at memory speed only when the prefetchers see long streams).
// N is padded to a multiple of eight with zeros. Q5 (GGUF's Q5_0 and Q5_1: 5-bit codes 0..31, w = q *
// scale + min) is Q4's record with the codes' fifth bits after the nibbles (one 32-byte chunk, bit b of
// int16 lane 2c + e the fifth bit of column c's code at input 2b + e): 6 bits per weight.
//
// The k-quants (Q4_K, Q5_K, Q6_K) keep llama.cpp's super-blocks of 256 inputs: one record per tile and
// super-block, a header then eight groups of 32 inputs. The header: the eight columns' float16 d, for
// Q4_K / Q5_K their float16 -dmin, then the sub-block scales as bytes [sub-block][column] (Q4_K / Q5_K:
// eight sub-blocks of 32, 6-bit unsigned; Q6_K: sixteen of 16, int8), then Q4_K / Q5_K's 6-bit mins
// [sub-block][column]. A group: Q4's 128 bytes of low nibbles, then the high bits (Q5_K: one 32-byte
// chunk, bit b of int16 lane 2c + e the fifth bit of column c's code at input 2b + e; Q6_K: two chunks,
// bits 2 (b % 8) and the next of chunk b / 8's lane 2c + e its fifth and sixth bits).
// w = d * sc * q - dmin * m (Q4_K, Q5_K) or d * sc * (q - 32) (Q6_K): d * sc and dmin * m are exact in
// float32 (11 significant bits times 6 or 8), so the record holds GGUF's values exactly, at 4.625,
// 5.625 and 6.5625 bits per weight (llama.cpp: 4.5, 5.5, 6.5625).
struct PackedWeight {
  enum class Format { kQ4, kQ8, kQ5, kQ4K, kQ5K, kQ6K };
  Format format;
  const uint8_t* tiles;
  const float* bias;  // nullptr: none
  int64_t N, K;
};

constexpr int64_t kTileColumns = 8;
constexpr int64_t kSuperBlock = 256;  // inputs per k-quant record

constexpr bool is_kquant(PackedWeight::Format format) {
  return format != PackedWeight::Format::kQ4 && format != PackedWeight::Format::kQ8 &&
         format != PackedWeight::Format::kQ5;
}

// Inputs one record covers: a group of 32, or a k-quant super-block of 256.
constexpr int64_t record_inputs(PackedWeight::Format format) { return is_kquant(format) ? kSuperBlock : kGroup; }

// Bytes of one record's codes (Q5's fifth bits included), and of the whole record (codes, scales and
// Q4 / Q5's mins).
constexpr int64_t code_bytes(PackedWeight::Format format) {
  return format == PackedWeight::Format::kQ8 ? kTileColumns * kGroup
                                             : kTileColumns * kGroup / 2 + (format == PackedWeight::Format::kQ5 ? 32 : 0);
}
// A k-quant record's header (scales and mins) and one group's codes.
constexpr int64_t kquant_header_bytes(PackedWeight::Format format) {
  return format == PackedWeight::Format::kQ6K ? 2 * kTileColumns + 16 * kTileColumns
                                               : 4 * kTileColumns + 16 * kTileColumns;
}
constexpr int64_t kquant_group_bytes(PackedWeight::Format format) {
  return kTileColumns * kGroup / 2 +
         (format == PackedWeight::Format::kQ5K ? 32 : format == PackedWeight::Format::kQ6K ? 64 : 0);
}
constexpr int64_t record_bytes(PackedWeight::Format format) {
  if (is_kquant(format)) return kquant_header_bytes(format) + (kSuperBlock / kGroup) * kquant_group_bytes(format);
  return code_bytes(format) + kTileColumns * 2 * (format == PackedWeight::Format::kQ8 ? 1 : 2);
}

// The kernels' view of a packed weight W [N, K]: tiles laid out as above (the format read from the
// record's size, which differs for each), and bias [N] float32 or undefined for none; fails unless the
// tensors are so.
PackedWeight packed_weight(const at::Tensor& tiles, const at::Tensor& bias, int64_t N, int64_t K);

// The inputs K of a weight from its tiles' shape [tiles, K / record_inputs, record_bytes].
int64_t packed_inputs(const at::Tensor& tiles);

// Where a block's outputs go: y[m, n] for m < M, rows `stride` floats apart (0: the weight's N);
// accumulate adds them to what y holds (a residual stream), as torch's y + projection would.
struct Output {
  float* y;
  bool accumulate;
  int64_t stride = 0;
};

// A projection of parts side by side, each packed in its own format (a fused q/k/v whose v is packed
// otherwise than q and k): part i computes columns offsets[i] .. offsets[i] + parts[i].N of N.
struct PackedParts {
  std::vector<PackedWeight> parts;
  std::vector<int64_t> offsets;
  int64_t N;
};

// The parts' tiles (each part's N the tiles' whole columns, the last one's what is left of N) and the
// whole projection's bias [N] float32 or undefined; fails unless the tensors are so.
PackedParts packed_parts(const std::vector<at::Tensor>& tiles, const at::Tensor& bias, int64_t N, int64_t K);

// M quantized rows times W^T, rounded to bfloat16 values, plus the bias: one phase of the team, its
// items blocks of 16 columns (two tiles) over a panel of rows (all of a decode step's).
// warmer: where given, asks for a few of its lines before each tile (DecodeStack's next attention).
void multiply(Team::Member& me, const PackedWeight& w, const QuantizedRows& x, int64_t M, const Output& out,
              Warmer* warmer = nullptr);

}  // namespace stepahead_cpu
