// Small AVX2 helpers the CPU kernels share.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace stepahead_cpu {

// The eight lanes of v added pairwise, always in the same order.
inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum(a * b) over n floats: eight lanes at a time, then the lanes, then the tail, always in that order.
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float total = sum_lanes(acc);
  for (; i < n; ++i) total = std::fma(a[i], b[i], total);
  return total;
}

}  // namespace stepahead_cpu
