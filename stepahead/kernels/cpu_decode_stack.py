"""The packed model's decoder layers as one C++ call for decode-only steps (kernels/decode_stack.cpp).

A one-token step on packed weights spent about half its time in Python: thirty layers of module
calls, each dispatching some twenty small operators. DecodeStack runs the same operators in the same
order from C++, so its output is bitwise the Python path's; the model uses it when every row of a
step is a generated token attended by the decode kernel (AttentionMetadata.single_decode_group) and
falls back to its layers otherwise (prompt rows, prefills, another attention path).
"""

from __future__ import annotations

import torch

from stepahead.kernels import cpu_build, cpu_ops
from stepahead.models.quant.quantized_linear import Int4Linear, Int8Linear, KQuantLinear


def build_decode_stack(model):
    """A DecodeStack over the model's layers, or None unless every projection of every layer runs
    stepahead's packed kernel, in any of its formats (Q4, Q8, the k-quants; each projection its own);
    torch's kernels, dense projections, Qwen3's per-head norms, tensor or pipeline ranks: those steps
    keep the Python path."""
    if model.ps.world_size > 1 or model.args.qk_norm or not model.layers:
        return None
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(p, Int4Linear | Int8Linear | KQuantLinear) and p.kernel == "stepahead"
                   for p in projections):
            return None
        tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for p in projections:
            tensors += [p.tiles, p.bias if p.bias is not None else torch.empty(0)]
        layers.append(tensors)
    attn = model.layers[0].self_attn
    return cpu_build.op("DecodeStack")(layers, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                       model.args.rms_norm_eps, attn.scale,
                                       cpu_ops.rms_norm_is_torchs(model.args.hidden_size))
