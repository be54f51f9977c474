// PagedDecode's loops (paged_decode_loops.h) on AVX-512's 16-float vectors, for processes whose CPU
// has AVX-512 (attention_uses_avx512). The build compiles every file for AVX2; this one switches the
// target to AVX-512 after its includes, so only its own code (the loops' copy in an anonymous
// namespace, this file's vectors) uses the wider instructions, and nothing it shares with the other
// files (torch's and the standard library's inline functions) is compiled for them.
//
// The arithmetic is AVX2's on twice the lanes: a score's multiply-adds along the head run in 16
// lanes (four per key of a 64-float head instead of eight), folded to eight (lane i plus lane i + 8)
// before the same transposing sum; the weighted sums hold 64 outputs per head in registers, for up
// to four query heads at a time; e^x is exp8's polynomial lane for lane (the same value per lane);
// the softmax sums 16 lanes, then folds. So a row's bits differ from the AVX2 path's within float
// rounding, and are the same in any batch, at any position, on any thread. Built by GCC only (its
// target pragma); another compiler keeps AVX2's loops.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "paged_decode.h"
#include "simd.h"

namespace stepahead_cpu {

bool attention_uses_avx512() {
#if defined(__GNUC__) && !defined(__clang__)
  static const bool wide = [] {
    // Opt-in: the 16-lane sums round differently from AVX2's (within float rounding), and that moves
    // near-tie tokens (the built-in model's answer to its capital-of-France check flips), so the default
    // stays on the loops whose bits every machine shares.
    const char* opt_in = std::getenv("STEPAHEAD_CPU_ATTENTION");
    if (opt_in == nullptr || std::string(opt_in) != "avx512") return false;
    const char* cap = std::getenv("STEPAHEAD_MAX_CPU_ISA");
    // avx512_vnni caps the packed GEMM at 256-bit vectors: no 512-bit ones here either
    if (cap != nullptr && (std::string(cap) == "avx2" || std::string(cap) == "avx512_vnni")) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return wide;
#else
  return false;  // the loops below are built by GCC only (its target pragma)
#endif
}

}  // namespace stepahead_cpu

#if defined(__GNUC__) && !defined(__clang__)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

namespace stepahead_cpu {

namespace {

// exp8 on sixteen lanes: the same operations lane for lane, masks in place of blends.
inline __m512 exp16(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(-87.3f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ);
  const __mmask16 overflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.7228f), _CMP_GT_OQ);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, lowest), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i two_to_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 y = _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), p, _mm512_castsi512_ps(two_to_n));
  y = _mm512_mask_blend_ps(overflow, y, _mm512_set1_ps(INFINITY));
  return _mm512_mask_blend_ps(nan, y, x);
}

// The loops' AVX-512 vectors (paged_decode_loops.h): sixteen floats.
struct AvxLanes16 {
  using Vec = __m512;
  static constexpr int kLanes = 16;
  // 4 keys x 4 heads of score sums, or 4 x 4 of output sums, fill 16 of the 32 registers
  static constexpr int kHeadsTogether = 4;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static Vec loadf(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load(const c10::BFloat16* p) {  // the upper half of a float's bits
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static Vec load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  static Vec exp(Vec x) { return exp16(x); }
  static __m256 fold8(Vec v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
  static float sum_lanes(Vec v) { return stepahead_cpu::sum_lanes(fold8(v)); }
  static float max_lanes(Vec v) {
    return stepahead_cpu::max_lanes(_mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
  }
};

}  // namespace

}  // namespace stepahead_cpu

#include "paged_decode_loops.h"

namespace stepahead_cpu {

void PagedDecode::run_wide(int64_t task, std::vector<float>& scratch) const {
  switch (cache_type_) {
    case at::kBFloat16: return run_as<c10::BFloat16, AvxLanes16>(task, scratch);
    case at::kHalf: return run_as<c10::Half, AvxLanes16>(task, scratch);
    default: return run_as<float, AvxLanes16>(task, scratch);
  }
}

}  // namespace stepahead_cpu

#pragma GCC pop_options

#else

namespace stepahead_cpu {

// never called: attention_uses_avx512() is false where the loops above are not built
void PagedDecode::run_wide(int64_t task, std::vector<float>& scratch) const { run(task, scratch); }

}  // namespace stepahead_cpu

#endif  // defined(__GNUC__) && !defined(__clang__)
