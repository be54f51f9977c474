"""What a proposer is to the SpecDecoder: given the requests that just sampled (their verified tokens
already appended) and how many drafts each may take, return each request's drafts.

Two kinds exist. A per-request proposer works on one request's token ids on the host (n-gram prompt
lookup; any other host-side method fits `PerRequestProposer` by giving it a function from a request's
tokens to its drafts). A batched proposer runs once over the whole batch (the draft model, k passes of a
second model across every request). A proposer that samples its drafts also returns the distribution q
each draft was drawn from, for the general rejection rule (rejection_sampler.py); a greedy or
deterministic one returns no q and its drafts are verified as one-hot proposals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from stepahead.worker.request_state import CachedRequestState


@dataclass
class ProposedDrafts:
    """Per request (in the order asked): its drafts, and where they were sampled, their distributions."""

    token_ids: list[list[int]]
    # per request: [len(token_ids[i]), vocab] float32 probabilities each draft was drawn from, or None
    # where the drafts are one-hot (greedy, or a host-side lookup)
    probs: list[torch.Tensor | None] = field(default_factory=list)

    def probs_of(self, i: int) -> torch.Tensor | None:
        return self.probs[i] if self.probs else None


class Proposer(ABC):
    @abstractmethod
    def propose(self, states: list[CachedRequestState], max_drafts: list[int]) -> ProposedDrafts:
        """Drafts to follow each request's token_ids, at most max_drafts[i] for states[i] (always >= 1)."""

    def finish(self, state: CachedRequestState) -> None:  # noqa: B027 (most proposers keep nothing)
        """The request finished: a proposer that learns from outputs (suffix) takes its output here."""

    def kv_bytes_per_token(self) -> int:
        """What the proposer keeps per token of the target's KV pool (a draft model: its own KV)."""
        return 0

    def allocate_kv(self, num_blocks: int) -> None:  # noqa: B027 (most proposers keep no KV)
        """Once the target's pool size is known: the proposer's KV over the same block ids."""


class PerRequestProposer(Proposer):
    """A host-side proposer that drafts from one request's token ids (prompt and outputs) at a time."""

    def __init__(self, propose_one: Callable[[np.ndarray], np.ndarray]) -> None:
        self.propose_one = propose_one

    def propose(self, states: list[CachedRequestState], max_drafts: list[int]) -> ProposedDrafts:
        return ProposedDrafts([self.propose_one(np.asarray(state.token_ids, dtype=np.int64))[:n].tolist()
                               for state, n in zip(states, max_drafts, strict=True)])
