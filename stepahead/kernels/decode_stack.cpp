// The decoder layers of a one-token-per-row step in one call from Python.
//
// On the packed path a decode step of one row spent about half its time in Python: the layers'
// module calls and the dispatch of some twenty operators per layer, each a few microseconds, thirty
// layers deep. This runs the same operators in the same order from C++: torch's add, silu and mul,
// index_copy_ for the KV write, and the kernels the Python layers call (rms_norm with torch's
// arithmetic, or torch's own where that is not available; int4 GEMM, rope, decode attention). The
// arithmetic is the Python path's, so its outputs are bitwise the same (tested), and a row's result
// still depends on the row alone.

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "decode_stack.h"
#include "ops.h"

namespace stepahead_cpu {

namespace {

// One packed projection: y = x W^T (+ bias), as the packed linear module computes it.
at::Tensor project(const at::Tensor& x, const Int4Weight& w) {
  at::Tensor y = int4_gemm(x, w.codes, w.scales, w.mins);
  return w.bias.defined() ? y + w.bias : y;
}

Int4Weight int4_weight(const std::vector<at::Tensor>& t, size_t first) {
  return Int4Weight{t[first], t[first + 1], t[first + 2], t[first + 3].numel() ? t[first + 3] : at::Tensor()};
}

}  // namespace

DecodeStack::DecodeStack(const std::vector<std::vector<at::Tensor>>& layers, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, double eps, double scale, bool exact_norm)
    : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale), exact_norm_(exact_norm) {
  for (const auto& t : layers) {
    TORCH_CHECK(t.size() == kTensorsPerLayer, "a layer takes ", kTensorsPerLayer, " tensors, got ", t.size());
    layers_.push_back(Layer{t[0], t[1], int4_weight(t, 2), int4_weight(t, 6), int4_weight(t, 10), int4_weight(t, 14)});
  }
}

at::Tensor DecodeStack::norm(const at::Tensor& h, const at::Tensor& weight) const {
  return exact_norm_ ? rms_norm(h, weight, eps_) : at::rms_norm(h, {h.size(1)}, weight, eps_);
}

at::Tensor DecodeStack::forward(at::Tensor h, const at::Tensor& cos_sin, const std::vector<at::Tensor>& k_caches,
                                const std::vector<at::Tensor>& v_caches, const at::Tensor& block_table,
                                const at::Tensor& seq_lens, const at::Tensor& slot_mapping) const {
  TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
              "one K and one V cache per layer");
  const int64_t rows = h.size(0), inter = layers_[0].down.codes.size(1) * 2;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& layer = layers_[i];
    // attention: norm, fused q/k/v projection, rope on q and k, the new K/V written, paged attention
    at::Tensor x = norm(h, layer.input_norm);
    at::Tensor qkv = project(x, layer.qkv).view({rows, heads_ + 2 * kv_heads_, head_dim_});
    at::Tensor qk = qkv.narrow(1, 0, heads_ + kv_heads_);
    rotary_embedding(qk, cos_sin);
    at::Tensor k = qkv.narrow(1, heads_, kv_heads_), v = qkv.narrow(1, heads_ + kv_heads_, kv_heads_);
    k_caches[i].view({kv_heads_, -1, head_dim_}).index_copy_(1, slot_mapping, k.transpose(0, 1));
    v_caches[i].view({kv_heads_, -1, head_dim_}).index_copy_(1, slot_mapping, v.transpose(0, 1));
    at::Tensor out = at::empty({rows, heads_, head_dim_}, h.options());
    paged_decode_attention(qkv.narrow(1, 0, heads_), k_caches[i], v_caches[i], block_table, seq_lens, scale_, out);
    h = h + project(out.view({rows, heads_ * head_dim_}), layer.o);
    // MLP: norm, fused gate/up projection, silu(gate) * up, down projection
    at::Tensor gate_up = project(norm(h, layer.post_norm), layer.gate_up);
    at::Tensor act = at::silu(gate_up.narrow(1, 0, inter)) * gate_up.narrow(1, inter, inter);
    h = h + project(act, layer.down);
  }
  return h;
}

}  // namespace stepahead_cpu
