"""The whole scheduler <-> worker contract: plain data, no torch.

Everything here crosses process boundaries (pickled to the worker process, msgspec to the API
server), so fields are ids, counts, block ids and diffs only (docs/design.md, "The scheduler-worker
contract").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stepahead.sampling_params import SamplingParams
from stepahead.tracing import TraceEvent


@dataclass
class NewRequestData:
    """Sent once, when a request is first scheduled (a resumed request comes as CachedRequestData)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # the prefix-cache hit length at admission


@dataclass
class CachedRequestData:
    """Diffs for requests the worker already knows. Parallel lists over running-then-resumed requests.

    No token ids travel for a running request: the worker feeds its own last sampled token.
    num_computed_tokens and num_output_tokens are the values before this step's increment.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    # Full token history, for requests the worker may not hold in its batch (resumed ones, and those
    # not scheduled in the previous step).
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)  # real outputs + placeholders

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = field(default_factory=set)
    # Some scheduled request samples under a grammar: the step needs a bitmask.
    has_structured_output_requests: bool = False
    # Some grammar has not seen a token still in flight: sampling must wait for the previous step
    # (docs/design.md, "Deferred sampling for grammars").
    pending_structured_output_tokens: bool = False
    step_id: int = 0  # the scheduler's step counter, for traces
    # Draft tokens each request verifies in this step, after its last known token: the proposed ids
    # (sync scheduling), or -1 placeholders the worker fills with its own drafts (async). A request
    # with drafts is scheduled for 1 + len(drafts) positions ending with them; it samples 1..that many.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @staticmethod
    def make_empty(finished_req_ids: set[str] | None = None, step_id: int = 0) -> SchedulerOutput:
        return SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids or set(), step_id=step_id)


@dataclass
class TokenLogprobs:
    """Logprobs for one sampled token: the sampled token first, then the top-N (which may repeat it)."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # 1-based rank of the sampled token in the full distribution


@dataclass
class PromptLogprobs:
    """Logprobs of a run of prompt tokens, computed by one step: entry i is the prompt token at
    position start + i (first, with its rank) and the top-N there. Position 0 never has one."""

    start: int
    entries: list[TokenLogprobs]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # Per request, in req_ids order: [] for a partial prefill, else the sampled token(s): with k drafts
    # verified, the accepted drafts and one more, 1..k+1 ids.
    sampled_token_ids: list[list[int]]
    # Per request id with logprobs requested: one entry per sampled token.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Worker-side accounting for EngineStats and traces: host time in the step's calls, and the time
    # the device spent on the step (CUDA events; the same as busy_s on CPU, where the host computes).
    busy_s: float = 0.0
    gpu_busy_s: float = 0.0
    trace_events: list[TraceEvent] = field(default_factory=list)
    # Requests whose sampling failed this step, with the reason: they fail alone (their entry in
    # sampled_token_ids is a stand-in, never delivered).
    failed: dict[str, str] = field(default_factory=dict)
    # Drafts proposed after this step's sampling, per request id: the synchronous scheduler schedules
    # them next step; the async one ignores them (the worker keeps its drafts and fills placeholders).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Per request id that asked for prompt logprobs and computed prompt positions this step.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Per request id: how many draft positions the async scheduler should reserve after each sampling
    # step (it schedules the drafts' positions before it has seen them): as many as the worker just
    # proposed, 0 while the request's drafts keep missing, so that drafting costs little when it does not hit.
    draft_slots: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def empty() -> ModelRunnerOutput:
        return ModelRunnerOutput([], [])


@dataclass
class GrammarOutput:
    structured_output_request_ids: list[str]
    grammar_bitmask: Any  # numpy int32 array [num_rows, ceil(vocab/32)], or None
    # With drafts: per request (in the order above), the drafts its rows follow; it then has 1 + that
    # many rows (its next token's, then one after each draft), packed request after request. None: one
    # row per request.
    draft_token_ids: list[list[int]] | None = None


@dataclass
class EngineCoreOutput:
    """One request's news from one step, as update_from_output reports it."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # None, "stop", "length", "abort", "error"
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    new_prompt_logprobs: PromptLogprobs | None = None
    first_scheduled_time: float | None = None  # on the first output: when the request was first scheduled

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
