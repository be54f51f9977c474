"""Attention over keys held as dense tensors, with the options the paged paths add: a sliding window
(as a mask) and logit soft-capping (which SDPA lacks, so those layers run the same math in torch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def visible_keys(q_pos: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """[len(q_pos), num_keys] bool: key j is visible to the query at position q_pos[i] when
    q_pos[i] - window < j <= q_pos[i] (no lower bound when window is None)."""
    keys = torch.arange(num_keys, device=q_pos.device)
    visible = keys.unsqueeze(0) <= q_pos.unsqueeze(1)
    if window is not None:
        visible &= keys.unsqueeze(0) > (q_pos - window).unsqueeze(1)
    return visible


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None = None, is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """SDPA's contract (q [..., heads, n, hd], k/v [..., kv_heads, m, hd], a bool mask broadcast to the
    scores, or is_causal), with softcap * tanh(score / softcap) applied to the scaled scores when
    softcap is set, as transformers' eager attention does."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        n, m = scores.shape[-2], scores.shape[-1]
        mask = visible_keys(torch.arange(m - n, m, device=q.device), m, None)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)
