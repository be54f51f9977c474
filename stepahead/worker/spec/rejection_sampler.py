"""Verification of drafts against the target model's samples in one forward pass.

Greedy: a step that verifies d drafts has the target's choice at each of its 1 + d sampled
positions (the last known token's, then each draft's). Drafts are accepted while they equal the
target's choice at their position; the target's choice at the first mismatch (or after the last
draft) follows them, so 1..d+1 tokens come out and they are exactly the tokens plain greedy
decoding would produce. Random sampling's accept/resample rule is not built yet.
"""

from __future__ import annotations

import torch


def greedy_verify(draft_token_ids: torch.Tensor, num_drafts: torch.Tensor,
                  target_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_token_ids [R, K] (padding past num_drafts[r] is ignored), num_drafts [R],
    target_token_ids [R, K + 1]: the target's choice at each position.

    Returns (num_accepted [R], output [R, K + 1]): row r's tokens are output[r, :num_accepted[r] + 1].
    """
    num_rows, k = draft_token_ids.shape
    valid = torch.arange(k, device=draft_token_ids.device).unsqueeze(0) < num_drafts.unsqueeze(1)
    match = (draft_token_ids == target_token_ids[:, :k]) & valid
    num_accepted = match.to(torch.int32).cumprod(dim=1).sum(dim=1)
    return num_accepted, target_token_ids


def accepted_lists(num_accepted: torch.Tensor, output: torch.Tensor) -> list[list[int]]:
    """Per row, the tokens a step delivers (one host transfer for the batch)."""
    counts = num_accepted.tolist()
    rows = output.tolist()
    return [row[:n + 1] for row, n in zip(rows, counts, strict=True)]
