// The CPU kernels' entry points (bindings.cpp hands them to Python).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace stepahead_cpu {

// y [M, N] = x [M, K] float32 times the packed [N, K] weight in tiles of eight columns, in any of its
// formats (Q4_0 / Q4_1's 4-bit codes, Q8_0's, the k-quants Q4_K, Q5_K and Q6_K; packed_gemm.h), which
// the tiles' record size names.
at::Tensor packed_gemm(const at::Tensor& x, const at::Tensor& tiles, int64_t N);

// Which instructions packed_gemm multiplies with here: "avx512_vnni" (vpdpwssd) or "avx2"
// (vpmaddwd and vpaddd); the same bits either way (packed_gemm.cpp).
std::string packed_gemm_isa();

// torch's rms_norm over the rows of a contiguous [rows, dim] float32 tensor, bitwise where torch sums
// in its AVX2 order (rms_norm.cpp).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Rotate-half rope of x [tokens, heads, head_dim] in place by cos_sin [tokens, 2, head_dim] (rope.cpp).
void rotary_embedding(at::Tensor& x, const at::Tensor& cos_sin);

// x's float32 values rounded to bfloat16 values in place (round_bf16.cpp); x contiguous.
void round_to_bf16_(at::Tensor& x);

// silu(gate) * up for gate_up [rows, 2 * features] holding gate then up in each row (silu_mul.cpp).
at::Tensor silu_mul(const at::Tensor& gate_up);

// One new token per row attending over its keys in the paged cache, into out (paged_decode.cpp);
// window > 0: over its last `window` keys only; softcap > 0: scores capped by softcap * tanh(s / softcap).
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, at::Tensor& out,
                            int64_t window, double softcap);

// Which vectors paged_decode_attention computes on here: "avx512" (16 floats, for heads of a multiple
// of 64 floats) or "avx2" (paged_decode_avx512.cpp says how their bits differ).
std::string paged_decode_isa();

// The new tokens' k and v [tokens, kv_heads, head_dim] (float32, unit stride within a head) into the
// paged caches at slot_mapping [tokens], converted to the caches' type, and k and v rewritten in place
// with the values the caches now hold (kv_store.cpp). Fails on a value beyond a float16 cache's range.
void write_kv_rows(at::Tensor& k, at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& slot_mapping);

}  // namespace stepahead_cpu
