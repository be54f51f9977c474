// The gated MLP's activation, silu(gate) * up = gate / (1 + e^-gate) * up, on x86 CPUs with AVX2.
//
// torch computes it as two operators (silu, then a multiply) with a temporary between them; here it is
// one pass over each row with the vectorized e^x of simd.h. A row's last values (past a multiple of
// eight) go through the same vector code in a padded buffer, so each value's result depends on its
// inputs alone, not on where it sits.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "ops.h"
#include "row_ops.h"
#include "simd.h"

namespace stepahead_cpu {

namespace {

constexpr int64_t kRowsPerTask = 16;

inline __m256 silu_times(__m256 gate, __m256 up) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate));
  return _mm256_mul_ps(_mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.f), e)), up);
}

}  // namespace

void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, silu_times(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  if (i == n) return;
  alignas(32) float g[8] = {}, u[8] = {}, o[8];
  std::copy(gate + i, gate + n, g);
  std::copy(up + i, up + n, u);
  _mm256_store_ps(o, silu_times(_mm256_load_ps(g), _mm256_load_ps(u)));
  std::copy(o, o + (n - i), out + i);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 2 == 0,
              "gate_up must be a float32 [rows, 2 * features] tensor with unit column stride");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(in + r * stride, in + r * stride + n, op + r * n, n);
  });
  return out;
}

}  // namespace stepahead_cpu
