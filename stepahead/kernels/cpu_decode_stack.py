"""The packed model's decoder layers as one C++ call for decode-only steps (kernels/decode_stack.cpp).

A one-token step on packed weights spent about half its time in Python: thirty layers of module
calls, each dispatching some twenty small operators. DecodeStack runs the same operators in the same
order from C++, so its output is bitwise the Python path's; the model uses it when every row of a
step is a generated token attended by the decode kernel (AttentionMetadata.single_decode_group) and
falls back to its layers otherwise (prompt rows, prefills, another attention path).
"""

from __future__ import annotations

from typing import cast

import torch

from stepahead.kernels import cpu_build, cpu_ops
from stepahead.models.quant.quantized_linear import Int4Linear, Int8Linear, KQuantLinear, PackedParts


def build_decode_stack(model):
    """A DecodeStack over the model's layers, or None unless every projection of every layer runs
    stepahead's packed kernel, in any of its formats (Q4, Q5, Q8, the k-quants; each projection its own,
    or its parts side by side in theirs: PackedParts); torch's kernels, dense projections, Qwen3's
    per-head norms, rope over part of each head, sliding windows or soft-capped attention, mixtures of
    experts, tensor or pipeline ranks: those steps keep the Python path."""
    args = model.args
    if (model.ps.world_size > 1 or args.qk_norm or args.partial_rotary_factor != 1.0
            or getattr(args, "moe", None) is not None or not model.layers):
        return None
    if any(layer.self_attn.window is not None or layer.self_attn.softcap is not None for layer in model.layers):
        return None
    layers, parts = [], []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        counts = []
        for p in projections:
            tiles = _part_tiles(p)
            if tiles is None:
                return None
            tensors += [*tiles, p.bias if p.bias is not None else torch.empty(0)]
            counts.append(len(tiles))
        layers.append(tensors)
        parts.append(counts)
    attn = model.layers[0].self_attn
    return cpu_build.op("DecodeStack")(layers, parts, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                       model.args.rms_norm_eps, attn.scale,
                                       cpu_ops.rms_norm_is_torchs(model.args.hidden_size))


def _part_tiles(projection) -> list[torch.Tensor] | None:
    """The packed tiles of a projection's parts (one, or PackedParts' several), or None where it does not
    run stepahead's packed kernel."""
    if isinstance(projection, PackedParts):
        return [cast(torch.Tensor, part.tiles) for part in projection.parts]
    if isinstance(projection, Int4Linear | Int8Linear | KQuantLinear) and projection.kernel == "stepahead":
        return [cast(torch.Tensor, projection.tiles)]
    return None
