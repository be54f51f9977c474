"""What callers of the offline API get back."""

from __future__ import annotations

from dataclasses import dataclass, field

LOGPROB_FLOOR = -9999.0  # the lowest logprob reported: -inf would not survive JSON


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    # One dict per generated token: token id -> Logprob (sampled token plus the top-N).
    logprobs: list[dict[int, Logprob]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # predicts it), else token id -> Logprob (the prompt token plus the top-N).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # time.monotonic() when the engine first scheduled the request (its queue time ends there).
    first_scheduled_time: float | None = None


def device_time_measured(device: str) -> bool:
    """Whether a worker on `device` times its steps on the device itself (CUDA events); on CPU the
    steps' device time is their host time again."""
    return device != "cpu"


@dataclass
class EngineStats:
    forward_steps: int = 0  # non-empty steps executed by the worker
    wasted_request_steps: int = 0  # request-slots computed for requests that had already finished
    busy_s: float = 0.0  # host time the worker spent in its step calls (Python, launches, CPU compute)
    gpu_busy_s: float = 0.0  # device time of the steps (CUDA events; on CPU the same as busy_s)
    wall_s: float = 0.0  # time the engine had work
    preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable blocks held by requests
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    device: str = "cpu"  # the worker's device type: "cuda" when gpu_busy_s is device time
    # Speculative decoding (vLLM's counters): request-steps that verified drafts, drafts verified,
    # drafts accepted, and per draft position how often it was accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def times_device(self) -> bool:
        """Whether gpu_busy_s is the device's own time (CUDA events) rather than the host time again."""
        return device_time_measured(self.device)

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted drafts / verified drafts (0 without any)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a drafting request-step delivers on average: 1 + its accepted drafts (vLLM's mean
        acceptance length; 0 without any drafting step)."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def utilization(self) -> float:
        """Host-side: the worker's busy time / wall time while the engine had work."""
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def gpu_utilization(self) -> float:
        """Device-side: the steps' device time / wall time while the engine had work."""
        return self.gpu_busy_s / self.wall_s if self.wall_s > 0 else 0.0
