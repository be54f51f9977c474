"""Logits of whole sequences in one causal pass, without a KV cache (teacher forcing).

For quality comparisons between two loadings of one model (quantized against dense): every position's
logits from the model's own layers, with attention done by plain causal SDPA instead of the paged cache.
"""

from __future__ import annotations

import torch

from stepahead.attention import dense


class _CausalAttention:
    """Step metadata for one sequence: its new tokens attend causally to each other only (within the
    layer's window, scores soft-capped where the layer has a cap)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv, scale: float,
               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        n = q.shape[0]
        mask = None if window is None else dense.visible_keys(torch.arange(n, device=q.device), n, window)
        out = dense.attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale, softcap,
                           is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(0, 1).contiguous()


class _NoCache:
    def layer(self, i: int) -> None:
        return None


@torch.no_grad()
def sequence_logits(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] float32 logits: row i predicts token i + 1."""
    ids = torch.tensor(token_ids, dtype=torch.long)
    positions = torch.arange(len(token_ids), dtype=torch.long)
    hidden = model(ids, positions, _NoCache(), _CausalAttention())
    return model.compute_logits(hidden).float()


@torch.no_grad()
def greedy_tokens(model, prompt: list[int], max_new: int) -> list[int]:
    """Greedy continuation by repeated full passes (slow, simple: for short quality checks)."""
    ids = list(prompt)
    for _ in range(max_new):
        ids.append(int(sequence_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]
