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
"""

from __future__ import annotations


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
