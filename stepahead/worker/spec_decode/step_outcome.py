"""A verifying step's outcome per request, as the sampler rank sends it to the other ranks.

Only the sampler rank (tensor rank 0 of the last pipeline stage) verifies drafts and proposes; every
other rank must still keep each request's token ids, computed count and next drafts as the sampler
keeps them, since it lays out the same rows (under async scheduling the drafts fill the scheduler's -1
slots). Per sampling row the outcome is the verified tokens (1..d+1: accepted drafts, then the target's
next token) and the drafts proposed after them (0..k), packed into one fixed-shape int64 tensor
[rows, 2k + 3]: the tokens' count, the tokens padded to k + 1, the drafts' count, the drafts padded
to k. A receiver knows the number of rows and each row's verified drafts from its own layout, so the
shape needs no separate message.
"""

from __future__ import annotations

import numpy as np
import torch

from stepahead.worker.request_state import CachedRequestState

PAD = -1


def outcome_width(num_speculative_tokens: int) -> int:
    return 2 * num_speculative_tokens + 3


def take_verified(state: CachedRequestState, num_drafts: int, tokens: list[int]) -> None:
    """Append a step's verified tokens and give back the positions of its rejected drafts."""
    state.token_ids.extend(tokens)
    state.num_computed_tokens -= num_drafts - (len(tokens) - 1)


def encode_outcomes(tokens: list[list[int]], drafts: list[list[int]], num_speculative_tokens: int) -> torch.Tensor:
    """[rows, 2k + 3] on the host: per row its verified tokens and its next drafts, each after its count."""
    k = num_speculative_tokens
    out = np.full((len(tokens), outcome_width(k)), PAD, dtype=np.int64)
    for i, (row_tokens, row_drafts) in enumerate(zip(tokens, drafts, strict=True)):
        if not 1 <= len(row_tokens) <= k + 1 or len(row_drafts) > k:
            raise RuntimeError(f"a step's outcome has {len(row_tokens)} verified tokens and {len(row_drafts)} "
                               f"drafts; at most {k + 1} and {k} fit")
        out[i, 0] = len(row_tokens)
        out[i, 1:1 + len(row_tokens)] = row_tokens
        out[i, k + 2] = len(row_drafts)
        out[i, k + 3:k + 3 + len(row_drafts)] = row_drafts
    return torch.from_numpy(out)


def apply_outcomes(outcomes: torch.Tensor, states: list[CachedRequestState], num_drafts: list[int],
                   num_speculative_tokens: int) -> None:
    """A non-sampling rank takes the sampler's outcome of a step: states[i] verified num_drafts[i] drafts
    (this rank laid them out as the sampler did); its drafts for the next step are the sampler's."""
    k = num_speculative_tokens
    rows = outcomes.cpu().numpy()
    if rows.shape != (len(states), outcome_width(k)):
        raise RuntimeError(f"a step's outcome has shape {rows.shape}, expected {(len(states), outcome_width(k))}")
    for state, row, row_num_drafts in zip(states, rows, num_drafts, strict=True):
        count, num_next = int(row[0]), int(row[k + 2])
        take_verified(state, row_num_drafts, row[1:1 + count].tolist())
        track = state.draft
        track.drafts = row[k + 3:k + 3 + num_next].tolist()
        track.probs = None  # drafts from the n-gram or suffix proposer are one-hot
        track.num_verifying = 0
