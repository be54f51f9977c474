// The packed GEMM's pieces (packed_gemm.cpp), for callers that split its work themselves (DecodeStack).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

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
// N is padded to a multiple of eight with zeros.
struct PackedWeight {
  enum class Format { kQ4, kQ8 };
  Format format;
  const uint8_t* tiles;
  const float* bias;  // nullptr: none
  int64_t N, K;
};

constexpr int64_t kTileColumns = 8;

// Bytes of one record's codes, and of the whole record (codes, scales and Q4's mins).
constexpr int64_t code_bytes(PackedWeight::Format format) {
  return kTileColumns * (format == PackedWeight::Format::kQ4 ? kGroup / 2 : kGroup);
}
constexpr int64_t record_bytes(PackedWeight::Format format) {
  return code_bytes(format) + kTileColumns * 2 * (format == PackedWeight::Format::kQ4 ? 2 : 1);
}

// The kernels' view of a 4-bit weight W [N, K]: tiles laid out as above, and bias [N] float32 or
// undefined for none; fails unless the tensors are so.
PackedWeight q4_weight(const at::Tensor& tiles, const at::Tensor& bias, int64_t N, int64_t K);

// Where a block's outputs go: y[m, n] for m < M, row stride N; accumulate adds them to what y holds
// (a residual stream), as torch's y + projection would.
struct Output {
  float* y;
  bool accumulate;
};

// M quantized rows times W^T, rounded to bfloat16 values, plus the bias: one phase of the team, its
// items blocks of 16 columns (two tiles) over a panel of rows (all of a decode step's).
// warmer: where given, asks for a few of its lines before each tile (DecodeStack's next attention).
void multiply(Team::Member& me, const PackedWeight& w, const QuantizedRows& x, int64_t M, const Output& out,
              Warmer* warmer = nullptr);

}  // namespace stepahead_cpu
