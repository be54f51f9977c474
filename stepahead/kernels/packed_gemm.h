// The packed GEMM's pieces (packed_gemm.cpp), for callers that split its work themselves (DecodeStack).
#pragma once

#include <cstdint>

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

// W [N, K] as 4-bit codes with scales and mins (GGUF's Q4_1 layout) or 8-bit codes with scales (Q8_0).
struct PackedWeight {
  enum class Format { kQ4, kQ8 };
  Format format;
  const uint8_t* codes;
  const float* scales;
  const float* mins;  // Q4 only
  const float* bias;  // nullptr: none
  int64_t N, K;
};

// Where a block's outputs go: y[m, n] for m < M, row stride N; accumulate adds them to what y holds
// (a residual stream), as torch's y + projection would.
struct Output {
  float* y;
  bool accumulate;
};

int64_t column_blocks(const PackedWeight& w);

// Columns [block * 16, block * 16 + 16) of M quantized rows times W^T, rounded to bfloat16 values,
// plus the bias.
void column_block(const PackedWeight& w, const QuantizedRows& x, int64_t M, int64_t block, const Output& out);

}  // namespace stepahead_cpu
