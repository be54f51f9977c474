// Float32 values rounded to bfloat16 values in place, on x86 CPUs with AVX2: what x.to(bfloat16)
// followed by .to(float32) computes for every finite value (round to nearest, ties to even), in one
// pass and without the two temporaries (for long prompts those copies were a large share of a
// projection).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <cstdint>

#include "ops.h"
#include "simd.h"

namespace stepahead_cpu {

constexpr int64_t kGrain = 32768;  // values per task, as torch's elementwise operators split theirs

void round_to_bf16_(at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous float32 tensor");
  float* p = x.data_ptr<float>();
  at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) _mm256_storeu_ps(p + i, round_to_bf16(_mm256_loadu_ps(p + i)));
    for (; i < end; ++i) p[i] = round_to_bf16(p[i]);
  });
}

}  // namespace stepahead_cpu
