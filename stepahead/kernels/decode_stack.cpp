// The decoder layers of a one-token-per-row step in one call from Python.
//
// On the packed path a decode step of one row spent about half its time in Python: the layers'
// module calls and the dispatch of some twenty operators per layer, each a few microseconds, thirty
// layers deep. This runs the same arithmetic in the same order from C++: the kernels the Python
// layers call (rms_norm with torch's arithmetic, or torch's own where that is not available; the packed
// GEMM, rope, silu(gate) * up, decode attention), and the residual adds and K/V writes, which are
// single float additions and copies (into a 16-bit cache rounded as torch rounds, kv_store.h). Its
// outputs are bitwise the Python path's (tested), and a row's result still depends on the row alone.
//
// The whole step is one parallel region (team.h) through its ~300 phases (a norm, a projection's
// column blocks, the attention tasks, ...), instead of a region per phase, whose thread wake-ups cost a
// one-token step a quarter of its time.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <utility>
#include <vector>

#include "decode_stack.h"
#include "kv_store.h"
#include "paged_decode.h"
#include "row_ops.h"
#include "team.h"

namespace stepahead_cpu {

namespace {

// A projection's parts' tiles (any packed formats) and bias, from index `first` of a layer's tensors;
// W [N, K].
PackedProjection projection(const std::vector<at::Tensor>& t, size_t first, int64_t parts, int64_t N, int64_t K) {
  TORCH_CHECK(parts >= 1 && first + parts < t.size(), "a layer's tensors end before its projections' parts");
  const std::vector<at::Tensor> tiles(t.begin() + first, t.begin() + first + parts);
  const at::Tensor bias = t[first + parts].numel() ? t[first + parts] : at::Tensor();
  return PackedProjection{tiles, bias, packed_parts(tiles, bias, N, K)};
}

}  // namespace

DecodeStack::DecodeStack(const std::vector<std::vector<at::Tensor>>& layers,
                         const std::vector<std::vector<int64_t>>& parts, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, double eps, double scale, bool exact_norm)
    : hidden_(0), inter_(0), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
      exact_norm_(exact_norm) {
  const int64_t q_dim = heads * head_dim, qkv_dim = (heads + 2 * kv_heads) * head_dim;
  TORCH_CHECK(parts.size() == layers.size(), "one list of part counts per layer");
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& t = layers[i];
    const auto& p = parts[i];
    TORCH_CHECK(p.size() == 4, "a layer has four projections, got ", p.size(), " part counts");
    TORCH_CHECK(t.size() == 2 + 4 + static_cast<size_t>(p[0] + p[1] + p[2] + p[3]),
                "a layer takes its two norms, then each projection's parts and bias");
    const size_t o = 2 + p[0] + 1, gate_up = o + p[1] + 1, down = gate_up + p[2] + 1;
    if (layers_.empty()) hidden_ = t[0].numel(), inter_ = packed_inputs(t[down]);  // down's inputs
    for (const at::Tensor* norm : {&t[0], &t[1]})
      TORCH_CHECK(norm->scalar_type() == at::kFloat && norm->is_contiguous() && norm->numel() == hidden_,
                  "the norm weights must be contiguous float32 [hidden] tensors");
    layers_.push_back(Layer{t[0], t[1], projection(t, 2, p[0], qkv_dim, hidden_),
                            projection(t, o, p[1], hidden_, q_dim), projection(t, gate_up, p[2], 2 * inter_, hidden_),
                            projection(t, down, p[3], hidden_, inter_)});
  }
}

void DecodeStack::check(const at::Tensor& h, const at::Tensor& cos_sin, const std::vector<at::Tensor>& k_caches,
                        const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping) const {
  TORCH_CHECK(h.dim() == 2 && h.size(1) == hidden_ && h.scalar_type() == at::kFloat,
              "h must be a float32 [rows, hidden] tensor");
  const int64_t rows = h.size(0);
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() &&
                  cos_sin.sizes() == at::IntArrayRef({rows, 2, head_dim_}),
              "cos_sin must be a contiguous float32 [rows, 2, head_dim] tensor");
  TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
              "one K and one V cache per layer");
  const int64_t slots = k_caches.empty() ? 0 : k_caches[0].size(1) * k_caches[0].size(2);
  for (const auto* caches : {&k_caches, &v_caches})
    for (const at::Tensor& c : *caches)
      TORCH_CHECK(c.sizes() == k_caches[0].sizes() && c.size(0) == kv_heads_ && c.size(3) == head_dim_,
                  "every cache must be [kv_heads, blocks, block_size, head_dim] like the first");
  check_slots(slot_mapping, rows, slots);
}

at::Tensor DecodeStack::forward(at::Tensor h_in, const at::Tensor& cos_sin, const std::vector<at::Tensor>& k_caches,
                                const std::vector<at::Tensor>& v_caches, const at::Tensor& block_table,
                                const at::Tensor& seq_lens, const at::Tensor& slot_mapping) const {
  check(h_in, cos_sin, k_caches, v_caches, slot_mapping);
  at::Tensor h = h_in.clone(at::MemoryFormat::Contiguous);  // the residual stream, updated in place
  const int64_t rows = h.size(0), hd = head_dim_, q_dim = heads_ * hd, qkv_dim = (heads_ + 2 * kv_heads_) * hd;
  if (rows == 0 || layers_.empty()) return h;
  const at::TensorOptions f32 = h.options();
  at::Tensor normed = at::empty({rows, hidden_}, f32), qkv = at::empty({rows, qkv_dim}, f32);
  at::Tensor attended = at::empty({rows, heads_, hd}, f32), gate_up = at::empty({rows, 2 * inter_}, f32);
  at::Tensor act = at::empty({rows, inter_}, f32);
  std::vector<PagedDecode> attention;  // each checks its operands here, outside the parallel region
  const at::Tensor q = qkv.view({rows, heads_ + 2 * kv_heads_, hd}).narrow(1, 0, heads_);
  for (size_t i = 0; i < layers_.size(); ++i)
    attention.emplace_back(q, k_caches[i], v_caches[i], block_table, seq_lens, scale_, attended);

  // the activations a projection reads, quantized (packed_gemm.h)
  const int64_t widest = std::max({hidden_, q_dim, inter_});
  std::vector<int16_t> codes(rows * widest);
  std::vector<float> x_scales(rows * widest / kGroup), x_sums(rows * widest / kGroup);
  const QuantizedRows xq{codes.data(), x_scales.data(), x_sums.data(), widest};

  float *hp = h.data_ptr<float>(), *np = normed.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
  float *ap = attended.data_ptr<float>(), *gp = gate_up.data_ptr<float>(), *actp = act.data_ptr<float>();
  const float* csp = cos_sin.data_ptr<float>();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int64_t slots = k_caches[0].size(1) * k_caches[0].size(2);
  const float eps = static_cast<float>(eps_);
  std::exception_ptr error;  // from the leader's torch operators, rethrown after the region
  std::atomic<bool> overflow{false};  // a K or V value beyond a float16 cache's range

  run_in_team(at::get_num_threads(), [&](Team::Member& me) {
    std::vector<float> scratch;  // this thread's attention buffers
    Warmer warmer;               // this thread's share of the next attention's keys and values
    const auto leader_runs = [&](auto&& torch_ops) {
      me.leader_runs([&] {
        if (error) return;
        try {
          torch_ops();
        } catch (...) {
          error = std::current_exception();
        }
      });
    };
    const auto quantize = [&](const float* x, int64_t K) {
      me.share(rows, 1, [&](int64_t r) { quantize_row(x + r * K, K, xq, r); });
    };
    const auto normalize = [&](const at::Tensor& weight) {  // normed = rms_norm(h), then quantized
      if (!exact_norm_) {
        leader_runs([&] { normed.copy_(at::rms_norm(h, {hidden_}, weight, eps_)); });
        quantize(np, hidden_);
        return;
      }
      const float* w = weight.data_ptr<float>();
      me.share(rows, 1, [&](int64_t r) {
        rms_norm_row(hp + r * hidden_, w, np + r * hidden_, hidden_, eps);
        quantize_row(np + r * hidden_, hidden_, xq, r);
      });
    };
    const auto project = [&](const PackedParts& w, float* y, bool accumulate) {
      for (size_t part = 0; part < w.parts.size(); ++part)
        multiply(me, w.parts[part], xq, rows, Output{y + w.offsets[part], accumulate, w.N}, &warmer);
    };
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      // attention: norm, fused q/k/v projection, rope on q and k, the new K/V written, paged attention
      normalize(layer.input_norm);
      project(layer.qkv.view, qkvp, false);
      me.share(rows, 1, [&](int64_t r) {
        float* row = qkvp + r * qkv_dim;
        rope_token(row, heads_ + kv_heads_, hd, csp + r * 2 * hd, hd);
        for (int64_t g = 0; g < kv_heads_; ++g) {
          const bool fits = store_rounded(row + (heads_ + g) * hd, hd, k_caches[i], (g * slots + slot[r]) * hd) &
                            store_rounded(row + (heads_ + kv_heads_ + g) * hd, hd, v_caches[i], (g * slots + slot[r]) * hd);
          if (!fits) overflow.store(true, std::memory_order_relaxed);
        }
      });
      const PagedDecode& attend = attention[i];
      me.share(attend.tasks(), 1, [&](int64_t task) { attend.run(task, scratch); });
      // while the projections up to the next layer's attention run, its keys and values are asked for
      warmer.clear();
      if (i + 1 < layers_.size())
        for (int64_t task = me.index(); task < attend.tasks(); task += me.members()) attention[i + 1].warm(task, warmer);
      quantize(ap, q_dim);
      project(layer.o.view, hp, true);
      // MLP: norm, fused gate/up projection, silu(gate) * up, down projection
      normalize(layer.post_norm);
      project(layer.gate_up.view, gp, false);
      me.share(rows, 1, [&](int64_t r) {
        silu_mul_row(gp + r * 2 * inter_, gp + r * 2 * inter_ + inter_, actp + r * inter_, inter_);
        quantize_row(actp + r * inter_, inter_, xq, r);
      });
      project(layer.down.view, hp, true);
    }
  });
  if (error) std::rethrow_exception(error);
  // as write_kv's check (attention/sdpa.py): loudly, not NaN outputs
  TORCH_CHECK(!overflow.load(), kFloat16RangeError);
  return h;
}

}  // namespace stepahead_cpu
