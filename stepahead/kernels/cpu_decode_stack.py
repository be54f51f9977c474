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
from stepahead.models.quant.quantized_linear import Int4Linear


def build_decode_stack(model):
    """A DecodeStack over the model's layers, or None unless every projection of every layer runs
    stepahead's int4 kernel (other packings, torch's kernel, Qwen3's per-head norms, rope over part of
    each head, sliding windows or soft-capped attention, mixtures of experts, tensor or pipeline ranks: those steps keep the Python path)."""
    args = model.args
    if (model.ps.world_size > 1 or args.qk_norm or args.partial_rotary_factor != 1.0
            or getattr(args, "moe", None) is not None or not model.layers):
        return None
    if any(layer.self_attn.window is not None or layer.self_attn.softcap is not None for layer in model.layers):
        return None
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(p, Int4Linear) and p.kernel == "stepahead" for p in projections):
            return None
        tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for p in projections:
            tensors += [p.tiles, p.bias if p.bias is not None else torch.empty(0)]
        layers.append(tensors)
    attn = model.layers[0].self_attn
    return cpu_build.op("DecodeStack")(layers, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                       model.args.rms_norm_eps, attn.scale,
                                       cpu_ops.rms_norm_is_torchs(model.args.hidden_size))
