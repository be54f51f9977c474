// RMSNorm with torch's exact arithmetic, without torch's ten operators.
//
// torch's CPU rms_norm (rms_norm_composite: pow, mean as sum then divide, add, rsqrt, two multiplies)
// cost about 80 microseconds per call on a one-token row, a fifth of a decode step. Its result must
// not change by a bit: the packed path's bf16 rounding turns a last-bit difference into logit changes
// of up to 0.1, enough to flip the built-in model's near ties. So this computes the same operations in
// the same order, including the order of torch's float sum over a contiguous row on an AVX2 build
// (ATen's SumKernel.cpp: the row as 8-lane vectors, four accumulators in a cascade of four levels,
// the vectors' tail into the first, then the four together, then the scalar tail and the eight lanes).
// The caller uses it only where a check on the spot finds torch's bits (cpu_ops.rms_norm_is_torchs:
// the AVX-512 build of torch on Zen 4 sums in this order too), and tests it bitwise against torch.

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops.h"
#include "row_ops.h"

namespace {

constexpr int64_t kLanes = 8, kIlp = 4, kLevels = 4;
constexpr int64_t kRowsPerTask = 64;

int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

inline __m256 square(const float* x) {
  const __m256 v = _mm256_loadu_ps(x);
  return _mm256_mul_ps(v, v);
}

// sum(x[i] * x[i]) over n floats, each square rounded, summed in torch's order.
float sum_of_squares(const float* x, int64_t n) {
  const int64_t vectors = n / kLanes, groups = vectors / kIlp;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(groups) / kLevels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  __m256 acc[kLevels][kIlp];
  for (auto& level : acc)
    for (auto& a : level) a = _mm256_setzero_ps();
  int64_t i = 0;
  while (i + level_step <= groups) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int64_t k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], square(x + (i * kIlp + k) * kLanes));
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kIlp; ++k) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < groups; ++i)
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], square(x + (i * kIlp + k) * kLanes));
  for (int64_t j = 1; j < kLevels; ++j)
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  for (int64_t v = groups * kIlp; v < vectors; ++v) acc[0][0] = _mm256_add_ps(acc[0][0], square(x + v * kLanes));
  for (int64_t k = 1; k < kIlp; ++k) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
  float total = 0.f;
  for (int64_t t = vectors * kLanes; t < n; ++t) total += x[t] * x[t];
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, acc[0][0]);
  for (float lane : lanes) total += lane;
  return total;
}

}  // namespace

namespace stepahead_cpu {

void rms_norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  const float mean = sum_of_squares(x, n) / static_cast<float>(n);
  const float inv_rms = 1.f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv_rms * w[i];
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous [rows, dim] float32 tensor");
  const int64_t rows = x.size(0), dim = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == dim,
              "weight must be a contiguous float32 [dim] tensor");
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * dim, wp, yp + r * dim, dim, eps_f);
  });
  return y;
}

}  // namespace stepahead_cpu
