"""The worker's side of speculative decoding: which drafts a step verifies, the sampling of every
position, verification, and the proposals for the next step (docs/design.md, "Speculative decoding
on the worker").

The model runner calls in at three points: laying out a step's tokens (`step_drafts`: the drafts
follow the request's last known token), keeping its own count of computed positions
(`num_computed`: the scheduler's runs ahead by rejections it has not processed yet), and sampling
(`verify_and_propose`: `sample_and_verify`, then `propose`). The verified tokens are read back to the host at once: the
proposers (proposer.py: the n-gram per request on the host, the draft model batched) start from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from stepahead.config import EngineConfig, SpeculativeConfig
from stepahead.core.sched_output import ModelRunnerOutput, TokenLogprobs
from stepahead.worker.request_state import CachedRequestState
from stepahead.worker.row_failures import sample_rows_apart
from stepahead.worker.sampled_feed import SampledTokenFeed
from stepahead.worker.sampler import logprobs_to_host, sample, sampling_probs
from stepahead.worker.sampling_metadata import RowSampling, SamplingMetadata
from stepahead.worker.spec_decode import spec_uniforms
from stepahead.worker.spec_decode.draft_budget import StepCost, allocate_drafts
from stepahead.worker.spec_decode.draft_model_proposer import DraftModelProposer
from stepahead.worker.spec_decode.ngram_proposer import NgramProposer
from stepahead.worker.spec_decode.proposer import PerRequestProposer, Proposer
from stepahead.worker.spec_decode.rejection_sampler import accept_drafts, rejection_sample
from stepahead.worker.spec_decode.step_outcome import encode_outcomes, take_verified
from stepahead.worker.spec_decode.suffix_proposer import SuffixProposer


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
    penalties, bad words, min_tokens and a seeded row's counter), exactly as plain decoding would at
    that point."""
    expanded = []
    for row, row_drafts in zip(rows, drafts, strict=True):
        expanded.append(row)
        for j in range(1, len(row_drafts) + 1):
            outputs = row.output_token_ids + row_drafts[:j] if row.params.reads_output_history else []
            expanded.append(RowSampling(row.params, row.prompt_token_ids, outputs, row.stop_token_ids,
                                        row.num_output_tokens + j))
    return expanded


def first_positions(drafts: list[list[int]]) -> list[int]:
    """Each request's first position among a step's sampled ones (1 + its drafts each, request after
    request), then the step's count of them."""
    return np.cumsum([0] + [1 + len(d) for d in drafts]).tolist()


def ngram_proposer(spec: SpeculativeConfig, max_model_len: int) -> Proposer:
    ngram = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min or 1, spec.prompt_lookup_max or 1,
                          max_model_len)
    return PerRequestProposer(ngram.propose)


def make_proposer(config: EngineConfig) -> Proposer:
    """The proposer of speculative_config.method (a draft model loads here)."""
    spec = config.speculative_config
    if spec is None:
        raise ValueError("speculative decoding needs a speculative_config")
    if spec.method == "ngram":
        return ngram_proposer(spec, config.scheduler_config.max_model_len)
    if spec.method == "draft_model":
        return DraftModelProposer(config)
    if spec.method == "suffix":
        return SuffixProposer(spec, config.scheduler_config.max_model_len)
    raise ValueError(f"speculative_config.method {spec.method!r} has no proposer on the worker")


class SpecDecoder:
    """Owns the proposer; the per-request drafting state lives in each CachedRequestState.draft.

    proposer None: a rank that does not sample (tensor or pipeline parallelism). It lays out the drafts
    the sampler rank proposed, which reach it with each step's outcome (sampled_feed.py), and neither
    verifies nor proposes."""

    def __init__(self, spec: SpeculativeConfig, proposer: Proposer | None) -> None:
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.disable_by_batch_size = spec.disable_by_batch_size
        self.proposer = proposer
        self.cost = StepCost() if spec.draft_policy == "cost" else None  # what a row costs, once measured

    def record_step(self, num_tokens: int, drafts: list[list[int]], seconds: float) -> None:
        """A step of num_tokens rows, sampling one row per request after its drafts, took `seconds`: the
        draft budget's measure of a row, taken from steps without prompt rows only."""
        if self.cost is not None and num_tokens == len(drafts) + sum(map(len, drafts)):
            self.cost.record(num_tokens, seconds)

    def kv_bytes_per_token(self) -> int:
        return self.proposer.kv_bytes_per_token() if self.proposer is not None else 0

    def allocate_kv(self, num_blocks: int) -> None:
        if self.proposer is not None:
            self.proposer.allocate_kv(num_blocks)

    def step_drafts(self, state: CachedRequestState, scheduled: list[int] | None) -> list[int]:
        """The drafts a step verifies after the request's last known token: the ids the synchronous
        scheduler sent back, or this worker's own for async scheduling's -1 placeholders (the last
        token repeated where it proposed fewer than the scheduler reserved: such a draft may even hit)."""
        track = state.draft
        track.verifying_probs = None
        if not scheduled:
            track.num_verifying = 0
            return []
        if scheduled[0] != -1:
            track.num_verifying = len(scheduled)
            if track.probs is not None and list(scheduled) == track.drafts[:len(scheduled)]:
                track.verifying_probs = track.probs[:len(scheduled)]
            return list(scheduled)
        own = track.drafts[:len(scheduled)]
        track.num_verifying = len(own)
        padding = [state.token_ids[-1]] * (len(scheduled) - len(own))
        if track.probs is not None and own:
            one_hot = track.probs.new_zeros(len(padding), track.probs.shape[1])
            one_hot[:, state.token_ids[-1]] = 1.0
            track.verifying_probs = torch.cat([track.probs[:len(own)], one_hot])
        return own + padding

    @staticmethod
    def num_computed(state: CachedRequestState, scheduler_count: int) -> int:
        """The positions of a running request this worker has computed and kept. The scheduler's
        count is never lower: it still includes the rejected drafts of steps it has not processed."""
        if scheduler_count < state.num_computed_tokens:
            raise RuntimeError(f"request {state.req_id}: the scheduler counts {scheduler_count} computed "
                               f"positions, the worker has {state.num_computed_tokens}")
        return state.num_computed_tokens

    def verify_and_propose(self, logits: torch.Tensor, rows: list[RowSampling], states: list[CachedRequestState],
                           drafts: list[list[int]], max_accepted: dict[int, int] | None,
                           feed: SampledTokenFeed | None) -> tuple[VerifiedStep, Proposals]:
        """A verifying step's sampling on the sampler rank: sample_and_verify, then propose; the other
        ranks (feed) get every request's verified tokens and next drafts, so they keep them as this one."""
        verified = self.sample_and_verify(logits, rows, drafts, [state.draft.verifying_probs for state in states],
                                          max_accepted)
        proposals = self.propose(states, drafts, verified)
        if feed is not None:
            feed.send(encode_outcomes(verified.tokens, [state.draft.drafts for state in states],
                                      self.num_speculative_tokens).to(feed.device))
        return verified, proposals

    def sample_and_verify(self, logits: torch.Tensor, rows: list[RowSampling], drafts: list[list[int]],
                          draft_probs: list[torch.Tensor | None] | None = None,
                          max_accepted: dict[int, int] | None = None) -> VerifiedStep:
        """logits: one row per position, request after request (1 + len(drafts[r]) each). draft_probs:
        per request the q its drafts were drawn from (None: one-hot drafts, or none); max_accepted: per
        row, the most drafts its grammar's masks allow to accept."""
        if not rows:
            return VerifiedStep([])
        expanded = expand_rows(rows, drafts)
        row_logprobs: dict[int, TokenLogprobs] = {}
        failed_positions: dict[int, str] = {}
        md: SamplingMetadata | None = None
        try:
            md = SamplingMetadata.from_rows(expanded, logits.shape[1], logits.device)
            sampled = sample(logits, md)
            targets = sampled.sampled_token_ids.tolist()
            if md.max_num_logprobs is not None:
                row_logprobs = logprobs_to_host(sampled, md, targets)
        except Exception as e:  # a row's failure fails its request, not the step
            apart = sample_rows_apart(logits, expanded, e)
            targets, row_logprobs, failed_positions = apart.token_ids, apart.logprobs, apart.failed
            md = None  # sampled row by row: keep the one-hot rule's tokens
        step = VerifiedStep(accept_drafts(drafts, targets, max_accepted))
        first = first_positions(drafts)
        if draft_probs is not None and md is not None:
            self._verify_drawn_drafts(step, logits, md, rows, drafts, first, draft_probs, max_accepted or {})
        for i, (row_drafts, tokens) in enumerate(zip(drafts, step.tokens, strict=True)):
            positions = range(first[i], first[i] + len(row_drafts) + 1)
            reasons = [failed_positions[p] for p in positions if p in failed_positions]
            if reasons:
                step.failed[i] = reasons[0]
            if first[i] in row_logprobs:
                step.logprobs[i] = [row_logprobs[first[i] + j] for j in range(len(tokens))]
        return step

    @staticmethod
    def _verify_drawn_drafts(step: VerifiedStep, logits: torch.Tensor, md: SamplingMetadata, rows: list[RowSampling],
                             drafts: list[list[int]], first: list[int], draft_probs: list[torch.Tensor | None],
                             max_accepted: dict[int, int]) -> None:
        """Rows whose drafts were drawn from a q get the general rule's tokens (rejection_sampler.py);
        not rows with logprobs, nor rows a grammar caps, whose tokens keep the one-hot rule's (valid for
        any drafts; the logprobs computed are of its tokens, and the grammar's masks cover its positions)."""
        general = [i for i, q in enumerate(draft_probs) if q is not None and drafts[i] and i not in max_accepted
                   and rows[i].params.logprobs is None and not rows[i].params.is_greedy]
        if not general:
            return
        positions = [first[i] + j for i in general for j in range(1 + len(drafts[i]))]
        p = sampling_probs(logits, md).index_select(0, torch.tensor(positions, device=logits.device))
        q = torch.cat([draft_probs[i] for i in general])  # type: ignore[misc]
        ids = torch.tensor([x for i in general for x in drafts[i]], dtype=torch.long, device=logits.device)
        params = [rows[i].params for i in general for _ in range(1 + len(drafts[i]))]
        index = [rows[i].num_output_tokens + j for i in general for j in range(1 + len(drafts[i]))]
        is_draft = [j < len(drafts[i]) for i in general for j in range(1 + len(drafts[i]))]
        accept_u = spec_uniforms.uniforms(params, index, spec_uniforms.ACCEPT, logits.device)
        resample_u = spec_uniforms.uniforms(params, index, spec_uniforms.RESAMPLE, logits.device)
        tokens = rejection_sample(p, q, ids, [len(drafts[i]) for i in general],
                                  accept_u[torch.tensor(is_draft, device=logits.device)], resample_u)
        for i, row_tokens in zip(general, tokens, strict=True):
            step.tokens[i] = row_tokens

    def propose(self, states: list[CachedRequestState], drafts: list[list[int]],
                step: VerifiedStep) -> Proposals:
        """Append each request's verified tokens, give back its rejected positions, and propose its
        next drafts (a grammar request's too: the scheduler's bitmask masks every draft position)."""
        if self.proposer is None:
            raise RuntimeError("only the sampler rank proposes drafts")
        # A batch this large drafts nothing (speculative_config.disable_by_batch_size).
        k = self.num_speculative_tokens if self.disable_by_batch_size is None or \
            len(states) < self.disable_by_batch_size else 0
        asking, max_drafts = [], []
        for state, row_drafts, tokens in zip(states, drafts, step.tokens, strict=True):
            take_verified(state, len(row_drafts), tokens)
            track = state.draft
            track.note_verified(len(tokens) - 1)
            track.drafts, track.probs = [], None
            if k and track.may_propose():
                asking.append(state)
                max_drafts.append(track.num_drafts(k))
        if asking and self.cost is not None and self.cost.fitted:  # the step's budget decides instead
            budget = allocate_drafts([s.draft.acceptance() for s in asking], [k] * len(asking), len(states),
                                     self.cost)
            asking = [s for s, n in zip(asking, budget, strict=True) if n]
            max_drafts = [n for n in budget if n]
        if asking:  # one call for the batch: a draft model runs its passes across every request at once
            proposed = self.proposer.propose(asking, max_drafts)
            for i, (state, ids) in enumerate(zip(asking, proposed.token_ids, strict=True)):
                state.draft.drafts = ids
                state.draft.probs = proposed.probs_of(i)
                if not ids:
                    state.draft.note_no_proposal()
        out = Proposals({}, {})
        for state in states:
            out.draft_token_ids[state.req_id] = list(state.draft.drafts)
            out.draft_slots[state.req_id] = len(state.draft.drafts)
        return out

    def finish(self, state: CachedRequestState) -> None:
        """The request finished (the suffix proposer keeps its output for the requests that follow)."""
        if self.proposer is not None:
            self.proposer.finish(state)

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
