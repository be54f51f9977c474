// DecodeStack: the decoder layers of a decode-only step in one call (decode_stack.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "packed_gemm.h"

namespace stepahead_cpu {

// A packed projection's tensors and the kernel's view of them.
struct PackedProjection {
  std::vector<at::Tensor> tiles;  // packed_gemm's operands, one per part, any format
  at::Tensor bias;                // undefined: none
  PackedParts view;
};

class DecodeStack {
 public:
  // Per layer, in this order: input norm weight, post-attention norm weight, then for each of the q/k/v,
  // o, gate/up and down projections its parts' tiles (`parts[layer][projection]` of them: one, or
  // several packed in different formats side by side) and its bias (an empty tensor for none).
  // exact_norm: stepahead's rms_norm is torch's arithmetic on this CPU (else torch's own is called).
  DecodeStack(const std::vector<std::vector<at::Tensor>>& layers, const std::vector<std::vector<int64_t>>& parts,
              int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, bool exact_norm);

  // h [rows, hidden] float32 (the residual stream entering the first layer), one new token per row:
  // the residual stream after the last layer. cos_sin [rows, 2, head_dim]: the tokens' rope rows; the
  // caches, tables and lengths as paged_decode_attention takes them; slot_mapping [rows]: where each
  // token's K/V goes.
  at::Tensor forward(at::Tensor h, const at::Tensor& cos_sin, const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& slot_mapping) const;

 private:
  struct Layer {
    at::Tensor input_norm, post_norm;
    PackedProjection qkv, o, gate_up, down;
  };
  std::vector<Layer> layers_;
  int64_t hidden_, inter_, heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  bool exact_norm_;

  void check(const at::Tensor& h, const at::Tensor& cos_sin, const std::vector<at::Tensor>& k_caches,
             const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping) const;
};

}  // namespace stepahead_cpu
