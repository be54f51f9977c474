"""The packed model's decoder layers as one C++ call for decode-only steps (kernels/decode_stack.cpp).

A one-token step on packed weights spent about half its time in Python: thirty layers of module
calls, each dispatching some twenty small operators. DecodeStack runs the same operators in the same
order from C++, so its output is bitwise the Python path's; the model uses it when every row of a
step is a generated token attended by the decode kernel (AttentionMetadata.single_decode_group) and
falls back to its layers otherwise (prompt rows, prefills, another attention path). Which models it
serves, and the tensors they hand it, the model decides (models/llama.py, build_decode_stack).
"""

from __future__ import annotations

from typing import Any

import torch

from stepahead.kernels import cpu_build, cpu_ops


def new_decode_stack(layers: list[list[torch.Tensor]], parts: list[list[int]], num_heads: int, num_kv_heads: int,
                     head_dim: int, rms_norm_eps: float, scale: float, hidden_size: int) -> Any:
    """A DecodeStack over each layer's tensors: its two norms' weights, then for each projection (qkv, o,
    gate_up, down) the packed tiles of its parts and its bias (an empty tensor for none); parts holds
    each layer's part counts. The norms run the kernel's own arithmetic where that is torch's at this
    width (cpu_ops.rms_norm_is_torchs)."""
    return cpu_build.op("DecodeStack")(layers, parts, num_heads, num_kv_heads, head_dim, rms_norm_eps, scale,
                                       cpu_ops.rms_norm_is_torchs(hidden_size))
