"""What a scheduler owns and how a request comes and goes outside a step.

RequestLifecycle holds every unfinished request, its queues (running, waiting, skipped_waiting), the KV
cache manager and the counters, and the ways a request enters and leaves them: admission, preemption,
finishing (aborts), freeing and failing. Scheduler (scheduler.py) builds the steps on it.
"""

from __future__ import annotations

import logging
from collections import deque

from stepahead.config import CacheConfig, SchedulerConfig
from stepahead.core.grammar_backend import StructuredOutputBackend
from stepahead.core.kv_cache import KVCacheManager
from stepahead.core.sched_output import EngineCoreOutput, SchedulerOutput
from stepahead.core.waiting_order import insert_by_priority
from stepahead.request import Request, RequestStatus, check_context_length
from stepahead.utils import cdiv

logger = logging.getLogger(__name__)


class RequestLifecycle:
    """The scheduler's state and every change to a request outside a step's scheduling and outputs.

    A finished or preempted request's blocks go back to the pool at once (docs/design.md, "Freeing
    blocks"); a request finished with steps in flight has those steps' outputs discarded.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.by_priority = scheduler_config.scheduling_policy == "priority"
        self.max_model_len = scheduler_config.max_model_len
        self.num_spec_tokens = scheduler_config.num_speculative_tokens
        self.kv_cache_manager = KVCacheManager(cache_config, scheduler_config.max_model_len)
        self.structured_output_manager: StructuredOutputBackend | None = None
        self.error_outputs: list[EngineCoreOutput] = []
        # The most tokens a request may hold: it computes at most this minus one positions, one KV
        # slot each. A pool smaller than one max_model_len sequence lowers it, so a request that
        # outgrows the pool finishes with "length" instead of preempting itself forever.
        pool_tokens = self.kv_cache_manager.num_usable_blocks * cache_config.block_size
        self.max_request_len = min(self.max_model_len, pool_tokens + 1)
        if self.kv_cache_manager.num_usable_blocks < cdiv(self.max_model_len, cache_config.block_size):
            logger.warning(
                "The KV cache holds %d tokens (%d usable blocks of %d), less than one max_model_len (%d) "
                "sequence; a request reaching %d tokens finishes with finish_reason 'length'.",
                pool_tokens, self.kv_cache_manager.num_usable_blocks, cache_config.block_size,
                self.max_model_len, self.max_request_len)

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.skipped_waiting: deque[Request] = deque()  # stale-gated; scanned before waiting
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.reset_preempted_req_ids: set[str] = set()
        self.prev_step_scheduled_req_ids: set[str] = set()
        self.current_step = 0
        self.num_preemptions = 0
        # Step slots computed for requests that had already finished (outputs discarded).
        self.num_wasted_request_steps = 0
        # Drafts verified and accepted, over every delivered output (vLLM's spec-decode counters):
        # num_drafts counts the request-steps that verified any; per position j, how often the j-th
        # draft of a step was accepted.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_drafts = 0
        self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        # Finished requests with steps still in flight: id -> their in-flight tokens. Lets those
        # steps' outputs be discarded even if the same id is re-added meanwhile.
        self.finished_in_flight_tokens: dict[str, int] = {}

        self.debug_invariants = scheduler_config.debug_invariants
        self._debug_in_flight: deque[SchedulerOutput] = deque()

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Validate first; on ValueError nothing has changed."""
        self._check_admissible(request)
        request.status = RequestStatus.WAITING
        grammar_manager = self.structured_output_manager
        if request.use_structured_output and grammar_manager is not None:
            grammar_manager.submit(request)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR  # until its grammar has compiled
        self.requests[request.request_id] = request
        if self.by_priority:
            insert_by_priority(self.waiting, request)
        else:
            self.waiting.append(request)

    def _check_admissible(self, request: Request) -> None:
        """What the scheduler itself needs (the frontend's InputProcessor checks the prompt in full)."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError("prompt_token_ids must not be empty")
        # The scheduler caps a long max_tokens at the context instead of rejecting it.
        check_context_length(num_prompt, self.max_model_len)
        usable = self.kv_cache_manager.num_usable_blocks * self.cache_config.block_size
        if num_prompt + 1 > usable:
            raise ValueError(
                f"prompt_token_ids has {num_prompt} tokens, but the KV cache holds only {usable} tokens "
                f"(num_blocks {self.cache_config.num_blocks} incl. the null block x block_size "
                f"{self.cache_config.block_size}); raise num_kv_blocks"
            )
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use by an unfinished request")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.skipped_waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        return len(self.finished_req_ids) > 0

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    # -- preemption, finishing, failing, freeing -------------------------------------------------------

    def _preempt_request(self, request: Request, drop_stale_output: bool) -> None:
        """The caller has removed the request from running. In-flight output becomes stale.

        Preemption is by recompute: the request keeps its tokens, loses its KV, and is admitted
        again from the front of waiting (docs/design.md, "Preemption").
        """
        assert request.status == RequestStatus.RUNNING, request
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # An undrained drop-mode share stays dropped: its positions have been resampled already.
        request.drop_stale_output = drop_stale_output or (
            request.drop_stale_output and request.num_stale_output_tokens > 0)
        # Assign, not add: the in-flight count already holds any undrained stale share.
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.num_in_flight_draft_tokens = 0
        request.spec_token_ids = []  # re-admission is a prefill; drafts come after its first sample
        request.is_prefill_chunk = False
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            insert_by_priority(self.waiting, request)
        else:
            self.waiting.appendleft(request)
        self.reset_preempted_req_ids.add(request.request_id)

    def finish_requests(self, request_ids: str | list[str], finished_status: RequestStatus) -> None:
        """External finishes (abort). Unknown or finished ids are ignored; no output is emitted."""
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self._remove_from_waiting(req)
            req.status = finished_status
            self._free_request(req)

    def _remove_from_waiting(self, request: Request) -> None:
        for queue in (self.waiting, self.skipped_waiting):
            try:
                queue.remove(request)
                return
            except ValueError:
                pass

    def _free_request(self, request: Request) -> None:
        rid = request.request_id
        self.finished_req_ids.add(rid)
        if request.num_in_flight_tokens > 0:
            left = self.finished_in_flight_tokens.get(rid, 0)  # an earlier holder of the id may still drain
            self.finished_in_flight_tokens[rid] = left + request.num_in_flight_tokens
        self.kv_cache_manager.free(request)  # at once: see docs/design.md, "Freeing blocks"
        del self.requests[rid]

    def fail_request(self, request_id: str, reason: str) -> None:
        """Finish one request with "error" and its reason (handed out by take_error_outputs); a step
        in flight for it is discarded as for an abort. The other requests go on."""
        if request_id not in self.requests:
            return
        logger.error("request %s failed: %s", request_id, reason)
        self.finish_requests([request_id], RequestStatus.FINISHED_ERROR)
        self.error_outputs.append(EngineCoreOutput(request_id, [], "error", reason))

    def take_error_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests that failed before running (their grammar did not compile)."""
        outputs, self.error_outputs = self.error_outputs, []
        return outputs

    # -- the prefix cache --------------------------------------------------------------------------

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache; optionally preempt every running request first (drop mode)."""
        if reset_running_requests:
            while self.running:  # reverse order keeps FIFO order at the front of waiting
                self._preempt_request(self.running.pop(), drop_stale_output=True)
        return self.kv_cache_manager.reset_prefix_cache()
