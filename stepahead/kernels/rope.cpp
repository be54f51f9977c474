// Rotary position embedding in place, over the query and key heads of the fused projection's output,
// in one call instead of torch's eight (two slices, a negation, a concatenation, two multiplies, an add
// and the split around them).
//
// Rotate-half convention, as HF checkpoints use: with a = x[:half], b = x[half:],
//     x[:half] = a * cos[:half] - b * sin[:half],   x[half:] = b * cos[half:] + a * sin[half:]
// each product rounded before the sum (the build passes -ffp-contract=off), the arithmetic of
// x * cos + rotate_half(x) * sin in torch.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <cstdint>

#include "ops.h"
#include "row_ops.h"

namespace {

constexpr int64_t kTokensPerTask = 64;

void rotate(float* x, const float* cos, const float* sin, int64_t half) {
  float* b = x + half;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 va = _mm256_loadu_ps(x + i), vb = _mm256_loadu_ps(b + i);
    const __m256 lo = _mm256_sub_ps(_mm256_mul_ps(va, _mm256_loadu_ps(cos + i)), _mm256_mul_ps(vb, _mm256_loadu_ps(sin + i)));
    const __m256 hi = _mm256_add_ps(_mm256_mul_ps(vb, _mm256_loadu_ps(cos + half + i)),
                                    _mm256_mul_ps(va, _mm256_loadu_ps(sin + half + i)));
    _mm256_storeu_ps(x + i, lo);
    _mm256_storeu_ps(b + i, hi);
  }
  for (; i < half; ++i) {
    const float a = x[i], bi = b[i];
    x[i] = a * cos[i] - bi * sin[i];
    b[i] = bi * cos[half + i] + a * sin[half + i];
  }
}

}  // namespace

namespace stepahead_cpu {

void rope_token(float* x, int64_t heads, int64_t head_stride, const float* cos_sin, int64_t rotary_dim) {
  for (int64_t h = 0; h < heads; ++h) rotate(x + h * head_stride, cos_sin, cos_sin + rotary_dim, rotary_dim / 2);
}

// x [tokens, heads, head_dim] (any token and head strides, unit stride within a head), rotated in
// place; cos_sin [tokens, 2, rotary_dim] contiguous: each token's cos and sin rows. The first
// rotary_dim features of each head rotate (rotary_dim < head_dim: Phi-4-mini's partial rope), the
// rest are left as they are.
void rotary_embedding(at::Tensor& x, const at::Tensor& cos_sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1,
              "x must be a float32 [tokens, heads, head_dim] tensor, unit stride within a head");
  const int64_t tokens = x.size(0), heads = x.size(1), hd = x.size(2);
  TORCH_CHECK(cos_sin.dim() == 3 && cos_sin.size(0) == tokens && cos_sin.size(1) == 2 && cos_sin.size(2) <= hd &&
                  cos_sin.size(2) % 2 == 0 && cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous(),
              "cos_sin must be a contiguous float32 [tokens, 2, rotary_dim] tensor, rotary_dim even and <= head_dim");
  const int64_t rot = cos_sin.size(2);
  float* xp = x.data_ptr<float>();
  const float* cs = cos_sin.data_ptr<float>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rope_token(xp + t * token_stride, heads, head_stride, cs + t * 2 * rot, rot);
  });
}

}  // namespace stepahead_cpu
