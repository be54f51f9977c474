"""Verification of drafts against the target model's samples in one forward pass.

A step that verifies d drafts samples the target at each of its 1 + d positions (the last known
token's, then each draft's), every position with the context of the drafts before it. Drafts are
accepted while they equal the target's sample at their position; the target's sample at the first
mismatch (or after the last draft) follows them, so 1..d+1 tokens come out.

Greedy rows: the samples are the argmax, so the tokens are exactly those plain greedy decoding gives.
Random rows: this is the standard accept/resample rule for a proposer whose distribution q is one-hot
on its draft x (the n-gram proposer's): the rule accepts x with probability min(1, p(x) / q(x)) = p(x),
and on rejection draws from max(p - q, 0) normalized, which is p restricted to tokens other than x.
Sampling t ~ p and accepting iff t == x gives x with probability p(x) and, otherwise, t distributed as
p given t != x: the same law. Each position keeps its own uniform (a seeded request's is a function of
its seed and output index), so a seeded request's tokens are the ones it gets without drafts.

A proposer that samples its drafts from a distribution q (the draft model, on random rows) is verified
by the general rule (`rejection_sample`): accept draft x with probability min(1, p(x) / q(x)), else draw
from normalize(max(p - q, 0)). A one-hot q makes it the rule above.
"""

from __future__ import annotations

import torch


def accept_drafts(drafts: list[list[int]], targets: list[int],
                  max_accepted: dict[int, int] | None = None) -> list[list[int]]:
    """drafts: per request, the drafts its step verified (possibly none); targets: the target's
    samples of every request's 1 + len(drafts) positions, request after request; max_accepted: per
    request index, at most this many drafts may be accepted (a grammar masked only the positions up to
    there: the sample at the cap is exact, the later ones are not).

    Returns per request the tokens the step delivers: the accepted drafts and the target's next sample.
    """
    tokens: list[list[int]] = []
    first = 0
    for i, row_drafts in enumerate(drafts):
        row = targets[first:first + len(row_drafts) + 1]
        num_accepted = 0
        limit = len(row_drafts) if max_accepted is None else min(len(row_drafts), max_accepted.get(i, len(row_drafts)))
        while num_accepted < limit and row_drafts[num_accepted] == row[num_accepted]:
            num_accepted += 1
        tokens.append(row[:num_accepted + 1])
        first += len(row_drafts) + 1
    if first != len(targets):
        raise ValueError(f"{len(targets)} target samples for {first} positions")
    return tokens


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
                     num_drafts: list[int], accept_uniforms: torch.Tensor,
                     resample_uniforms: torch.Tensor) -> list[list[int]]:
    """The general rule for drafts drawn from a distribution q, for every request at once.

    target_probs [positions, vocab]: p at each of a request's 1 + d positions, request after request;
    draft_probs [drafts, vocab] and draft_ids [drafts]: each draft's q and id, request after request;
    accept_uniforms [drafts] and resample_uniforms [positions]: one uniform each. Draft j is accepted
    with probability min(1, p(x) / q(x)) while the ones before it were; at the first rejection the token
    is drawn from max(p - q, 0) normalized, after the last draft from p (the bonus token). Whatever q,
    each delivered token is distributed as p.

    Returns per request the accepted drafts and the drawn token."""
    device = target_probs.device
    nd = torch.tensor(num_drafts, dtype=torch.long, device=device)
    width = max(num_drafts, default=0)
    pos_start = torch.cumsum(nd + 1, 0) - (nd + 1)
    draft_start = torch.cumsum(nd, 0) - nd
    j = torch.arange(width, device=device).unsqueeze(0)
    valid = j < nd.unsqueeze(1)  # [requests, width]
    last_draft = max(draft_ids.shape[0] - 1, 0)
    d_idx = (draft_start.unsqueeze(1) + j).clamp_(max=last_draft)
    p_idx = pos_start.unsqueeze(1) + j
    x = draft_ids[d_idx] if draft_ids.numel() else d_idx
    if draft_ids.numel():
        px = target_probs[p_idx.clamp(max=target_probs.shape[0] - 1), x]
        qx = draft_probs[d_idx, x]
        # u < p/q, written without dividing (q(x) > 0 for a drawn draft)
        accepted = (accept_uniforms[d_idx] * qx < px) & valid
    else:
        accepted = valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # accepted while every earlier one was
    rejected = num_accepted < nd
    p = target_probs[pos_start + num_accepted]
    if draft_ids.numel():
        q = draft_probs[(draft_start + num_accepted).clamp(max=last_draft)] * rejected.unsqueeze(1)
        residual = (p - q).clamp_(min=0.0)
    else:
        residual = p
    # p == q at a rejected position cannot happen with probability > 0; fall back to p there.
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)
    c = residual.cumsum(dim=1)
    u = resample_uniforms[pos_start + num_accepted]
    drawn = torch.searchsorted(c, (u * c[:, -1]).unsqueeze(1), right=True).squeeze(1)
    drawn = drawn.clamp_(max=target_probs.shape[1] - 1)
    counts, ids, tokens = num_accepted.tolist(), x.tolist(), drawn.tolist()
    return [ids[r][:counts[r]] + [tokens[r]] for r in range(len(num_drafts))]
