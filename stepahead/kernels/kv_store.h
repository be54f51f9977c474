// Writing one token's K or V into the paged cache (DecodeStack and write_kv_rows).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace stepahead_cpu {

// What a step that overflowed a float16 cache fails with (DecodeStack and write_kv_rows alike).
constexpr const char* kFloat16RangeError =
    "a key or value is beyond float16's range (65504), which the KV cache holds: run with --kv-cache-dtype "
    "bfloat16 or float32";

// slot_mapping must be a contiguous int64 [tokens] tensor of slots in [0, slots): where each new
// token's K and V go in a cache of `slots` slots (DecodeStack and write_kv_rows alike).
inline void check_slots(const at::Tensor& slot_mapping, int64_t tokens, int64_t slots) {
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == tokens,
              "slot_mapping must be a contiguous int64 [tokens] tensor");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot ", slot[t], " of token ", t, " is outside the cache");
}

// n values into a cache of type T, converted as torch converts (round to nearest even), and `values`
// rewritten with what the cache now holds, so that the step attends to exactly the cache's values.
// False where a finite value overflowed float16's range.
inline bool store_rounded(float* values, int64_t n, float* out) {
  std::copy_n(values, n, out);
  return true;
}

inline bool store_rounded(float* values, int64_t n, c10::BFloat16* out) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = values[i];  // c10's conversion is torch's
    values[i] = static_cast<float>(out[i]);
  }
  return true;
}

// Eight at a time with F16C (rounding to nearest even, as torch's conversion for every non-NaN value;
// a NaN keeps its payload instead of becoming torch's canonical one).
inline bool store_rounded(float* values, int64_t n, c10::Half* out) {
  bool fits = true;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(values + i);
    const __m128i halves = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), halves);
    const __m256 back = _mm256_cvtph_ps(halves);
    _mm256_storeu_ps(values + i, back);
    // |back| infinite where |x| was finite: overflow
    const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.f), back);
    const __m256 was = _mm256_andnot_ps(_mm256_set1_ps(-0.f), x);
    const __m256 overflowed = _mm256_and_ps(_mm256_cmp_ps(magnitude, _mm256_set1_ps(INFINITY), _CMP_EQ_OQ),
                                            _mm256_cmp_ps(was, _mm256_set1_ps(INFINITY), _CMP_LT_OQ));
    fits &= _mm256_movemask_ps(overflowed) == 0;
  }
  for (; i < n; ++i) {
    out[i] = values[i];
    const float back = static_cast<float>(out[i]);
    fits &= !(std::isinf(back) && std::isfinite(values[i]));
    values[i] = back;
  }
  return fits;
}

// The same, for a cache tensor's element `at` of whichever of the three types it holds.
inline bool store_rounded(float* values, int64_t n, const at::Tensor& cache, int64_t at) {
  switch (cache.scalar_type()) {
    case at::kBFloat16: return store_rounded(values, n, cache.data_ptr<c10::BFloat16>() + at);
    case at::kHalf: return store_rounded(values, n, cache.data_ptr<c10::Half>() + at);
    default: return store_rounded(values, n, cache.data_ptr<float>() + at);
  }
}

}  // namespace stepahead_cpu
