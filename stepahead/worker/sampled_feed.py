"""Sampled tokens for the ranks that do not sample (tensor- and pipeline-parallel workers).

Only the sampler rank (tensor rank 0 of the last pipeline stage) samples. It broadcasts each step's
sampled ids to every rank; the other ranks need them as the sampler does: the first stage embeds them
(substituting the -1 placeholders of the next step on the device, as at one rank), and every rank
checks its layout against each request's token count. A rank does not wait for a step's broadcast
when it samples: it waits only when a later step touches one of that step's requests. With sync
scheduling at pipeline depth P the steps in flight hold different requests, so the first stage runs
step N+1 while the last stage still computes step N.

With speculative decoding a step's outcome per request is its verified tokens and its next drafts
(worker/spec_decode/step_outcome.py): the sampler broadcasts one [rows, 2k + 3] tensor per step instead of
[rows] ids, and applying it also gives back the rejected positions and sets the request's drafts. The
host then holds every token, so nothing is substituted on the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from stepahead.distributed.comm import broadcast_sampled
from stepahead.distributed.state import ParallelState
from stepahead.worker.request_state import CachedRequestState
from stepahead.worker.spec_decode.step_outcome import apply_outcomes, outcome_width


@dataclass
class _PendingStep:
    work: Any  # the broadcast's handle
    ids: torch.Tensor  # filled when work completes
    states: list[CachedRequestState]  # the sampling rows' requests, in row order
    req_ids: list[str]
    num_drafts: list[int] | None  # with speculation: the drafts each row verified (ids holds outcomes)


class SampledTokenFeed:
    """The broadcasts of sampled ids a non-sampler rank has posted and not applied yet, oldest first."""

    def __init__(self, ps: ParallelState, device: torch.device, num_speculative_tokens: int = 0) -> None:
        self.ps = ps
        self.device = device
        self.num_speculative_tokens = num_speculative_tokens
        self._pending: deque[_PendingStep] = deque()
        self._sent: deque[tuple[Any, torch.Tensor]] = deque()  # the sampler's broadcasts in flight

    def send(self, ids: torch.Tensor) -> None:
        """Sampler rank: broadcast this step's ids, or with speculation its outcomes (without waiting
        for the receivers)."""
        if ids.numel() == 0:  # a step whose every row is a partial prefill: the receivers skip it too
            return
        ids = ids.contiguous()
        self._sent.append((broadcast_sampled(ids, self.ps), ids))
        while self._sent and self._sent[0][0].is_completed():
            self._sent.popleft()

    def expect(self, states: list[CachedRequestState], req_ids: list[str], num_drafts: list[int] | None = None) -> None:
        """Other ranks: post the receive of this step's ids (one per sampling row), or with speculation
        its outcomes (num_drafts: the drafts each row verifies)."""
        if not states:
            return
        shape = (len(states),) if num_drafts is None else (len(states), outcome_width(self.num_speculative_tokens))
        ids = torch.empty(shape, dtype=torch.long, device=self.device)
        self._pending.append(_PendingStep(broadcast_sampled(ids, self.ps), ids, states, req_ids, num_drafts))

    def apply_through(self, req_ids: Iterable[str]) -> tuple[torch.Tensor, dict[str, int]] | None:
        """Wait for and apply, oldest first, every pending step up to the newest that sampled one of
        req_ids. Returns the newest applied step's (ids, row of each request), or None if none was (or
        with speculation, where the host holds every token)."""
        wanted = set(req_ids)
        last = -1
        for i, step in enumerate(self._pending):
            if not wanted.isdisjoint(step.req_ids):
                last = i
        applied = None
        for _ in range(last + 1):
            step = self._pending.popleft()
            step.work.wait()
            if step.num_drafts is not None:
                apply_outcomes(step.ids, step.states, step.num_drafts, self.num_speculative_tokens)
                continue
            for state, token in zip(step.states, step.ids.tolist(), strict=True):
                state.token_ids.append(token)
            applied = (step.ids, {req_id: i for i, req_id in enumerate(step.req_ids)})
        return applied
