// One row's share of the kernels in ops.h, for callers that split rows between threads themselves
// (DecodeStack). Each is the arithmetic its whole-tensor kernel applies to that row.
#pragma once

#include <cstdint>

namespace stepahead_cpu {

// y = x / sqrt(mean(x^2) + eps) * w over n floats, in torch's AVX2 order (rms_norm.cpp).
void rms_norm_row(const float* x, const float* w, float* y, int64_t n, float eps);

// Rotate-half rope of one token's heads in place: x holds `heads` heads `head_stride` floats apart;
// cos_sin is the token's [2, rotary_dim] row, and the first rotary_dim floats of each head rotate (rope.cpp).
void rope_token(float* x, int64_t heads, int64_t head_stride, const float* cos_sin, int64_t rotary_dim);

// out = silu(gate) * up over n floats (silu_mul.cpp).
void silu_mul_row(const float* gate, const float* up, float* out, int64_t n);

}  // namespace stepahead_cpu
