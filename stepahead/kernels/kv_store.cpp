// The new tokens' K and V into a 16-bit paged cache in one pass (attention/sdpa.py, write_kv): torch's
// way (convert, check the range, index_copy_, convert back) takes several times as long as the
// float32 cache's copy (docs/BENCHMARKS.md, section 14.4).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>

#include "kv_store.h"
#include "ops.h"

namespace stepahead_cpu {

void write_kv_rows(at::Tensor& k, at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  slot_mapping.device().is_cpu(),
              "write_kv_rows runs on CPU tensors");
  TORCH_CHECK(k.dim() == 3 && k.scalar_type() == at::kFloat && k.stride(2) == 1 && v.sizes() == k.sizes() &&
                  v.scalar_type() == at::kFloat && v.stride(2) == 1,
              "k and v must be float32 [tokens, kv_heads, head_dim] tensors with unit stride in head_dim");
  const int64_t tokens = k.size(0), kv_heads = k.size(1), hd = k.size(2);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  k_cache.size(0) == kv_heads && k_cache.size(3) == hd,
              "k_cache and v_cache must be contiguous [kv_heads, blocks, block_size, head_dim] tensors of one type");
  const int64_t slots = k_cache.size(1) * k_cache.size(2);
  check_slots(slot_mapping, tokens, slots);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  std::atomic<bool> overflow{false};
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    bool fits = true;
    for (int64_t t = begin; t < end; ++t)
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t at = (g * slots + slot[t]) * hd;
        fits &= store_rounded(kp + t * k.stride(0) + g * k.stride(1), hd, k_cache, at);
        fits &= store_rounded(vp + t * v.stride(0) + g * v.stride(1), hd, v_cache, at);
      }
    if (!fits) overflow.store(true, std::memory_order_relaxed);
  });
  TORCH_CHECK(!overflow.load(), kFloat16RangeError);
}

}  // namespace stepahead_cpu
