"""The per-request record the scheduler owns, its status, and the context-length check (torch-free)."""

from __future__ import annotations

import enum
import time
from typing import Any

from stepahead.sampling_params import SamplingParams
from stepahead.validation import InvalidInputError


class RequestStatus(enum.IntEnum):
    """Ordered: every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()  # queued, but its grammar is still compiling
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def check_context_length(num_prompt_tokens: int, max_model_len: int, num_completion_tokens: int = 1) -> None:
    """Raise InvalidInputError (a ValueError) unless the prompt and the completion fit in max_model_len.

    num_completion_tokens is the request's max_tokens, or 1 where the request leaves it open: at
    least one token is always generated, so a prompt must be shorter than max_model_len. The wording
    is the OpenAI one, which API clients match on.
    """
    num_requested = num_prompt_tokens + num_completion_tokens
    if num_requested <= max_model_len:
        return
    raise InvalidInputError(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{num_requested} tokens ({num_prompt_tokens} in the messages, {num_completion_tokens} in the completion). "
        "Please reduce the length of the messages or completion."
    )


class Request:
    """One generation request and the scheduler's counters for it.

    num_computed_tokens is optimistic: it counts every scheduled position, including those of steps
    still in flight. num_output_placeholders counts the tokens that in-flight steps will produce
    (docs/design.md, "Placeholders"); num_in_flight_tokens counts the positions of steps whose output
    has not been processed yet, and num_stale_output_tokens the part of those scheduled before the
    request's last preemption (docs/design.md, "Stale output").
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        max_model_len: int | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        # The model's other end tokens (Llama 3's <|eot_id|>, ...): they finish the request as EOS does.
        self.extra_eos_token_ids = extra_eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority  # lower runs earlier under the priority scheduling policy
        self.cache_salt = cache_salt
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        max_tokens = sampling_params.max_tokens
        if max_tokens is None:
            # The rest of the context; without a known context length, effectively unbounded.
            max_tokens = (max_model_len - self.num_prompt_tokens) if max_model_len else 1 << 30
        self.max_tokens = max(max_tokens, 0)

        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_in_flight_tokens = 0
        self.num_stale_output_tokens = 0
        self.drop_stale_output = False
        self.is_prefill_chunk = False
        # Draft tokens to verify in the request's next step: the worker's proposals (sync scheduling),
        # or -1 placeholders for drafts the worker keeps (async); docs/design.md, "Draft tokens as
        # placeholders".
        self.spec_token_ids: list[int] = []
        # Drafts scheduled in steps whose output has not been processed, those scheduled before the
        # last preemption excepted; part of num_output_placeholders under async scheduling.
        self.num_in_flight_draft_tokens = 0
        # How many draft positions the worker asks the async scheduler to reserve per step (fewer than
        # k while the request's drafts keep missing); None: k.
        self.num_draft_slots: int | None = None
        # A grammar request under async scheduling: the worker's latest proposals, which fill its next
        # step's draft slots (the bitmask masks each of their positions).
        self.worker_draft_token_ids: list[int] = []
        self.num_preemptions = 0
        self.num_cached_tokens = -1
        self.first_scheduled_time: float | None = None  # time.monotonic() of its first admission (metrics)
        self.block_hashes: list[int] = []
        self.use_structured_output = sampling_params.structured_outputs is not None
        # The grammar hook's per-request state (its compile and matcher); set when the request is added.
        self.structured_output: Any = None

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
            return
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, num_tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, placeholders={self.num_output_placeholders}, "
            f"in_flight={self.num_in_flight_tokens}, stale={self.num_stale_output_tokens}"
            + (f", drafts={self.num_in_flight_draft_tokens}" if self.num_in_flight_draft_tokens else "") + ")"
        )
