"""The worker's side of speculative decoding: which drafts a step verifies, the sampling of every
position, verification, and the proposals for the next step (docs/design.md, "Speculative decoding
on the worker").

The model runner calls in at three points: laying out a step's tokens (`step_drafts`: the drafts
follow the request's last known token), keeping its own count of computed positions
(`num_computed`: the scheduler's runs ahead by rejections it has not processed yet), and sampling
(`sample_and_verify`, then `propose`). Everything here is per request on the host: the n-gram
proposer reads the verified tokens there, so the runner reads each step's samples back at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from stepahead.config import SpeculativeConfig
from stepahead.core.sched_output import ModelRunnerOutput, TokenLogprobs
from stepahead.worker.request_state import CachedRequestState
from stepahead.worker.row_failures import sample_rows_apart
from stepahead.worker.sampler import logprobs_to_host, sample
from stepahead.worker.sampling_metadata import RowSampling, SamplingMetadata
from stepahead.worker.spec.ngram_proposer import NgramProposer
from stepahead.worker.spec.rejection_sampler import accept_drafts
from stepahead.worker.spec.suffix_proposer import SuffixProposer


@dataclass
class VerifiedStep:
    """One step's outcome per sampling row (request), in sample-row order."""

    tokens: list[list[int]]  # accepted drafts then the target's next token: 1..d+1 ids
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)  # rows that asked: one per token
    failed: dict[int, str] = field(default_factory=dict)  # rows whose sampling failed, and why


@dataclass
class Proposals:
    """What the worker tells the scheduler after proposing, per request id."""

    draft_token_ids: dict[str, list[int]]  # the drafts (the synchronous scheduler sends them back)
    draft_slots: dict[str, int]  # draft positions the async scheduler should reserve


def expand_rows(rows: list[RowSampling], drafts: list[list[int]]) -> list[RowSampling]:
    """One sampling row per position: row r's position j sees the drafts before it as outputs (for
    penalties, min_tokens and a seeded row's counter), exactly as plain decoding would at that point."""
    expanded = []
    for row, row_drafts in zip(rows, drafts, strict=True):
        expanded.append(row)
        for j in range(1, len(row_drafts) + 1):
            outputs = row.output_token_ids + row_drafts[:j] if row.params.uses_penalties else []
            expanded.append(RowSampling(row.params, row.prompt_token_ids, outputs, row.stop_token_ids,
                                        row.num_output_tokens + j))
    return expanded


class SpecDecoder:
    """Owns the proposer; the per-request drafting state lives in each CachedRequestState.draft."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        if config.method not in ("ngram", "suffix"):
            raise ValueError(f"speculative_config.method {config.method!r} has no proposer on the worker")
        self.num_speculative_tokens = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        self.proposer: NgramProposer | SuffixProposer
        if config.method == "suffix":
            self.proposer = SuffixProposer(config, max_model_len)
        else:
            self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min or 1,
                                          config.prompt_lookup_max or 1, max_model_len)

    def step_drafts(self, state: CachedRequestState, scheduled: list[int] | None) -> list[int]:
        """The drafts a step verifies after the request's last known token: the ids the synchronous
        scheduler sent back, or this worker's own for async scheduling's -1 placeholders (the last
        token repeated where it proposed fewer than the scheduler reserved: such a draft may even hit)."""
        track = state.draft
        if not scheduled:
            track.num_verifying = 0
            return []
        if scheduled[0] != -1:
            track.num_verifying = len(scheduled)
            return list(scheduled)
        own = track.drafts[:len(scheduled)]
        track.num_verifying = len(own)
        return own + [state.token_ids[-1]] * (len(scheduled) - len(own))

    @staticmethod
    def num_computed(state: CachedRequestState, scheduler_count: int) -> int:
        """The positions of a running request this worker has computed and kept. The scheduler's
        count is never lower: it still includes the rejected drafts of steps it has not processed."""
        if scheduler_count < state.num_computed_tokens:
            raise RuntimeError(f"request {state.req_id}: the scheduler counts {scheduler_count} computed "
                               f"positions, the worker has {state.num_computed_tokens}")
        return state.num_computed_tokens

    def sample_and_verify(self, logits: torch.Tensor, rows: list[RowSampling], drafts: list[list[int]],
                          max_accepted: dict[int, int] | None = None) -> VerifiedStep:
        """logits: one row per position, request after request (1 + len(drafts[r]) each); max_accepted:
        per row, the most drafts its grammar's masks allow to accept."""
        if not rows:
            return VerifiedStep([])
        expanded = expand_rows(rows, drafts)
        row_logprobs: dict[int, TokenLogprobs] = {}
        failed_positions: dict[int, str] = {}
        try:
            md = SamplingMetadata.from_rows(expanded, logits.shape[1], logits.device)
            sampled = sample(logits, md)
            targets = sampled.sampled_token_ids.tolist()
            if md.max_num_logprobs is not None:
                row_logprobs = logprobs_to_host(sampled, md, targets)
        except Exception as e:  # a row's failure fails its request, not the step
            apart = sample_rows_apart(logits, expanded, e)
            targets, row_logprobs, failed_positions = apart.token_ids, apart.logprobs, apart.failed
        step = VerifiedStep(accept_drafts(drafts, targets, max_accepted))
        first = 0
        for i, (row_drafts, tokens) in enumerate(zip(drafts, step.tokens, strict=True)):
            positions = range(first, first + len(row_drafts) + 1)
            reasons = [failed_positions[p] for p in positions if p in failed_positions]
            if reasons:
                step.failed[i] = reasons[0]
            if first in row_logprobs:
                step.logprobs[i] = [row_logprobs[first + j] for j in range(len(tokens))]
            first += len(row_drafts) + 1
        return step

    def propose(self, states: list[CachedRequestState], drafts: list[list[int]],
                step: VerifiedStep) -> Proposals:
        """Append each request's verified tokens, give back its rejected positions, and propose its
        next drafts (a grammar request's too: the scheduler's bitmask masks every draft position)."""
        out = Proposals({}, {})
        # A batch this large drafts nothing (speculative_config.disable_by_batch_size).
        k = self.num_speculative_tokens if self.disable_by_batch_size is None or \
            len(states) < self.disable_by_batch_size else 0
        for state, row_drafts, tokens in zip(states, drafts, step.tokens, strict=True):
            state.token_ids.extend(tokens)
            state.num_computed_tokens -= len(row_drafts) - (len(tokens) - 1)
            track = state.draft
            track.note_verified(len(tokens) - 1)
            track.drafts = []
            if k and track.may_propose():
                if isinstance(self.proposer, SuffixProposer):
                    proposed = self.proposer.propose(state.req_id, state.token_ids, track.resets)
                else:
                    proposed = self.proposer.propose(np.asarray(state.token_ids, dtype=np.int64)).tolist()
                track.drafts = proposed[:track.num_drafts(k)]
                if not track.drafts:
                    track.note_no_proposal()
            out.draft_token_ids[state.req_id] = list(track.drafts)
            out.draft_slots[state.req_id] = len(track.drafts)
        return out

    def finish(self, state: CachedRequestState) -> None:
        """The request finished (the suffix proposer keeps its output for the requests that follow)."""
        if isinstance(self.proposer, SuffixProposer):
            self.proposer.finish(state.req_id, state.output_token_ids)

    @staticmethod
    def to_output(req_ids: list[str], sample_rows: list[int], step: VerifiedStep,
                  proposals: Proposals) -> ModelRunnerOutput:
        """The step's ModelRunnerOutput: 1..d+1 tokens per sampling request, [] for a partial prefill."""
        sampled_token_ids: list[list[int]] = [[] for _ in req_ids]
        logprobs = {}
        for i, b in enumerate(sample_rows):
            sampled_token_ids[b] = step.tokens[i]
            if i in step.logprobs:
                logprobs[req_ids[b]] = step.logprobs[i]
        out = ModelRunnerOutput(req_ids, sampled_token_ids, logprobs, draft_token_ids=proposals.draft_token_ids,
                                draft_slots=proposals.draft_slots)
        out.failed = {req_ids[sample_rows[i]]: reason for i, reason in step.failed.items()}
        return out
