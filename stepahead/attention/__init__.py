"""Paged attention: a layer the models use (it never imports them, nor the worker).

The model runner lays a step's rows out (rows.BatchRow) and asks its backend for the step's metadata;
each layer then calls paged_attention, which writes the new tokens' K/V at their slots and attends over
the paged cache the way that metadata's backend does: SDPA over gathered blocks on CPU (sdpa.py), or
Triton kernels that read the block table directly on CUDA (triton_backend.py, triton_paged.py).
The layers' other fused Triton kernels (q/k norm + rope, residual add + RMSNorm: triton_fused.py) sit
beside them, so that triton_aot.py compiles every Triton kernel from this one layer.
"""

from __future__ import annotations

import torch

from stepahead.attention.paged_cache import LayerKV


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, metadata,
                    scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [T, heads, hd], k/v [T, kv_heads, hd] for the step's new tokens -> attention output [T, heads, hd].

    window: the layer's attention window (a token attends to itself and the window - 1 tokens before
    it; None: to its whole context); keys before it are never read into the output, so the blocks
    that hold only such keys may be gone. softcap: scores become softcap * tanh(score / softcap)
    before the softmax (None: as they are)."""
    return metadata.attend(q, k, v, kv, scale, window, softcap)
