"""EngineCore: the step function over a scheduler, an executor and a batch queue.

With max_concurrent_batches == 1, _step() schedules, runs and processes one step at a time. Above
that, _step_with_batch_queue() keeps up to that many steps in flight: it schedules step N+1 and
starts it before blocking on step N's output (docs/design.md, "Batch-queue depth").
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import NamedTuple

from stepahead.config import EngineConfig, ModelConfig
from stepahead.core.async_scheduler import AsyncScheduler
from stepahead.core.sched_output import EngineCoreOutput, GrammarOutput, ModelRunnerOutput, SchedulerOutput
from stepahead.core.scheduler import Scheduler
from stepahead.errors import EngineDeadError
from stepahead.executor.abstract import Executor
from stepahead.outputs import EngineStats
from stepahead.request import Request, RequestStatus
from stepahead.structured_output import StructuredOutputManager
from stepahead.tracing import TraceEvent

_HEALTH_POLL_S = 1.0  # how often a blocked wait asks the executor whether its worker is alive
_GRAMMAR_WAIT_S = 0.05  # the longest an idle step waits for a compiling grammar (the step lock is held)


class InFlightStep(NamedTuple):
    """A step submitted to the executor whose output has not been processed yet."""

    sample_future: Future  # resolves to the step's ModelRunnerOutput
    scheduler_output: SchedulerOutput
    execute_future: Future  # the forward pass; the same future as sample_future for an empty step


class EngineCore:
    """Runs the engine loop: schedule, hand the step to the executor, process its output.

    Owns the scheduler (AsyncScheduler when async scheduling is on), the executor, the batch queue
    of in-flight steps, the abort queue and the engine statistics. Guarantees: every scheduled step's
    output is processed exactly once, oldest first; at most max_concurrent_batches steps are in
    flight; aborts (from any thread) are applied between steps, before the next output is
    processed; an executor failure finishes every unfinished request with "error" and makes every
    later call raise EngineDeadError instead of hanging.
    """

    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        if executor.num_kv_blocks is not None and executor.num_kv_blocks != config.cache_config.num_blocks:
            # The worker sized the pool from device memory: the scheduler hands out exactly those blocks.
            config = dataclasses.replace(
                config, cache_config=dataclasses.replace(config.cache_config, num_blocks=executor.num_kv_blocks))
        self.config = config
        scheduler_cls = AsyncScheduler if config.async_scheduling else Scheduler
        self.scheduler: Scheduler = scheduler_cls(config.scheduler_config, config.cache_config)
        if config.structured_outputs_backend == "xgrammar":
            self.scheduler.structured_output_manager = make_structured_output_manager(config.model_config)
        self.executor = executor
        self.batch_queue_size = config.max_concurrent_batches
        self.batch_queue: deque[InFlightStep] = deque()  # newest on the left
        self._step_fn = self._step if self.batch_queue_size == 1 else self._step_with_batch_queue
        self._aborts: list[str] = []
        self._aborts_lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._dead: str | None = None
        self._trace = config.trace
        self._trace_events: list[TraceEvent] = []
        # Statistics.
        self._forward_steps = 0
        self._busy_s = 0.0
        self._gpu_busy_s = 0.0
        self._wall_s = 0.0
        self._work_since: float | None = None
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished_by_reason: dict[str, int] = {}
        # Tokens of each step since the last take_step_tokens (the server's iteration_tokens_total, as
        # vLLM counts them: the tokens a step generated plus the prompts of the requests whose first token
        # it generated); None: nobody reads them, so nothing is kept.
        self._step_tokens: list[int] | None = None
        self._prompts_before_first_token: dict[str, int] = {}

    # -- requests ----------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._check_alive()
        with self._step_lock:
            self.scheduler.add_request(request)
        self._prompt_tokens += request.num_prompt_tokens
        self._prompts_before_first_token[request.request_id] = request.num_prompt_tokens

    def abort_requests(self, request_ids: list[str]) -> None:
        """Thread-safe. Applied before the next update_from_output, or now if nothing is in flight."""
        with self._aborts_lock:
            self._aborts.extend(request_ids)
        if self._step_lock.acquire(blocking=False):
            try:
                if not self.batch_queue:
                    self._process_aborts()
            finally:
                self._step_lock.release()

    def _process_aborts(self) -> None:
        with self._aborts_lock:
            ids, self._aborts = self._aborts, []
        if not ids:
            return
        for rid in ids:
            self._prompts_before_first_token.pop(rid, None)
        live = [rid for rid in ids if rid in self.scheduler.requests]
        self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        self._count_finished("abort", len(live))

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache; with reset_running_requests, preempt running requests (drop mode)."""
        self._check_alive()
        with self._step_lock:
            return self.scheduler.reset_prefix_cache(reset_running_requests)

    # -- stepping ----------------------------------------------------------------------------------

    def has_work(self) -> bool:
        if self._dead is not None:
            return False
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def step(self) -> list[EngineCoreOutput]:
        """One iteration of the step function; may return []."""
        self._check_alive()
        with self._step_lock:
            now = time.monotonic()
            if self._work_since is None:
                self._work_since = now
            try:
                outputs = self._step_fn() + self.scheduler.take_error_outputs()
            except EngineDeadError:
                raise
            except Exception as e:  # any executor failure kills the engine
                raise self._die(e) from e
            for output in outputs:
                self._generation_tokens += len(output.new_token_ids)
                if output.finish_reason is not None:
                    self._count_finished(output.finish_reason)
            if not self.has_work():
                self._wall_s += time.monotonic() - self._work_since
                self._work_since = None
            return outputs

    def _step(self) -> list[EngineCoreOutput]:
        """One step at a time: schedule, execute, sample, process."""
        self._process_aborts()  # nothing is in flight between synchronous steps
        if not self.scheduler.has_requests():
            return []
        scheduler_output = self._schedule()
        execute_future = self.executor.execute_model(scheduler_output)
        grammar = self._grammar_bitmask(scheduler_output)  # on the CPU while the forward pass runs
        model_output = self._wait(execute_future)
        if model_output is None:
            model_output = self._wait(self.executor.sample_tokens(grammar))
        self._process_aborts()
        return self._update(scheduler_output, model_output)

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Keep up to batch_queue_size steps in flight; process the oldest when the queue is full.

        1. With nothing in flight, apply pending aborts. Schedule a step (if the scheduler has any
           request) and submit its forward pass (execute_model).
        2. Submit its sampling (sample_tokens) right away, unless a grammar must first see the
           token of the step still in flight; then the step is held back (deferred).
        3. Return [] without blocking when the new step joined the queue, the queue is not full and
           there is more to schedule (the step ran tokens, or requests remain), so the next call
           schedules again while the worker computes. With no request at all and an empty queue,
           return [] too.
        4. Otherwise pop the oldest in-flight step and wait for its output (and for its forward
           pass, which surfaces a failure); for a deferred step, every step in flight, oldest first,
           since at depth > 2 its grammars may await tokens of more than one of them.
        5. Apply the aborts that arrived meanwhile.
        6. Process the output (update_from_output).
        7. A deferred step now samples: its grammars have seen every earlier token; it joins the queue.
        (docs/design.md, "Batch-queue depth" and "Deferred sampling for grammars")
        """
        queue = self.batch_queue
        deferred: SchedulerOutput | None = None
        execute_future: Future | None = None
        if not queue:
            self._process_aborts()
        if self.scheduler.has_requests():
            scheduler_output = self._schedule()
            execute_future = self.executor.execute_model(scheduler_output)
            executed = scheduler_output.total_num_scheduled_tokens > 0
            if not executed:
                sample_future = execute_future
            elif not scheduler_output.pending_structured_output_tokens or not queue:
                sample_future = self._sample(scheduler_output)
            else:
                # The grammars must first see the tokens in flight: sample after processing them.
                deferred = scheduler_output
            if deferred is None:
                queue.appendleft(InFlightStep(sample_future, scheduler_output, execute_future))
                if len(queue) < self.batch_queue_size and (executed or self.scheduler.has_requests()):
                    return []
        elif not queue:
            return []
        outputs = self._process_oldest()
        if deferred is not None:
            assert execute_future is not None
            while queue:
                outputs += self._process_oldest()
            sample_future = self._sample(deferred)
            queue.appendleft(InFlightStep(sample_future, deferred, execute_future))
        return outputs

    def _process_oldest(self) -> list[EngineCoreOutput]:
        """Wait for the oldest in-flight step (and its forward pass, which surfaces a failure), apply
        the aborts that arrived meanwhile, and process its output."""
        oldest = self.batch_queue.pop()
        model_output = self._wait(oldest.sample_future)
        if oldest.sample_future is not oldest.execute_future:
            self._wait(oldest.execute_future)
        self._process_aborts()
        return self._update(oldest.scheduler_output, model_output)

    def _sample(self, scheduler_output: SchedulerOutput) -> Future:
        """Submit a step's sampling, with its grammars' bitmask."""
        grammar = self._grammar_bitmask(scheduler_output)
        start = time.monotonic()
        future = self.executor.sample_tokens(grammar)
        if self._trace:
            self._trace_events.append(TraceEvent("sample_tokens", "engine", start, time.monotonic(),
                                                 {"step": scheduler_output.step_id, "grammar": grammar is not None}))
        return future

    def _grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        start = time.monotonic()
        grammar = self.scheduler.get_grammar_bitmask(scheduler_output)
        if grammar is not None and self._trace:
            self._trace_events.append(TraceEvent(
                "grammar_bitmask", "engine", start, time.monotonic(),
                {"step": scheduler_output.step_id, "reqs": len(grammar.structured_output_request_ids)}))
        return grammar

    def _schedule(self) -> SchedulerOutput:
        start = time.monotonic()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            self.scheduler.wait_for_grammars(_GRAMMAR_WAIT_S)
        if self._trace:
            self._trace_events.append(TraceEvent(
                "schedule", "engine", start, time.monotonic(),
                {"step": scheduler_output.step_id, "tokens": scheduler_output.total_num_scheduled_tokens,
                 "reqs": len(scheduler_output.num_scheduled_tokens)}))
        return scheduler_output

    def _update(self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        start = time.monotonic()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        step_tokens = self._count_step_tokens(outputs)
        if scheduler_output.total_num_scheduled_tokens > 0:
            self._forward_steps += 1
            if self._step_tokens is not None:
                self._step_tokens.append(step_tokens)
        self._busy_s += model_output.busy_s
        self._gpu_busy_s += model_output.gpu_busy_s
        if self._trace:
            self._trace_events.extend(model_output.trace_events)
            self._trace_events.append(TraceEvent(
                "update_from_output", "engine", start, time.monotonic(),
                {"step": scheduler_output.step_id, "outputs": len(outputs)}))
        return outputs

    def _wait(self, future: Future):
        """Block on a worker future without hanging on a dead worker."""
        while True:
            try:
                return future.result(timeout=_HEALTH_POLL_S)
            except FutureTimeout:
                self.executor.check_health()

    # -- failure -----------------------------------------------------------------------------------

    def _die(self, cause: BaseException) -> EngineDeadError:
        self._dead = f"engine core died: executor failed with {cause!r}"
        sched = self.scheduler
        ids = list(sched.requests)
        sched.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        self.batch_queue.clear()
        self._count_finished("error", len(ids))
        if self._work_since is not None:
            self._wall_s += time.monotonic() - self._work_since
            self._work_since = None
        # Every request in flight carries the cause, not only the requests that come later.
        return EngineDeadError(self._dead, [EngineCoreOutput(rid, [], "error", self._dead) for rid in ids])

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    # -- stats and traces --------------------------------------------------------------------------

    def _count_finished(self, finish_reason: str, num_requests: int = 1) -> None:
        if num_requests:
            self._finished_by_reason[finish_reason] = self._finished_by_reason.get(finish_reason, 0) + num_requests

    def get_stats(self) -> EngineStats:
        sched = self.scheduler
        kv = sched.kv_cache_manager
        wall = self._wall_s + (time.monotonic() - self._work_since if self._work_since is not None else 0.0)
        return EngineStats(
            forward_steps=self._forward_steps,
            wasted_request_steps=sched.num_wasted_request_steps,
            busy_s=self._busy_s,
            gpu_busy_s=self._gpu_busy_s,
            wall_s=wall,
            preemptions=sched.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + len(sched.skipped_waiting),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_usable_blocks,
            finished_by_reason=dict(self._finished_by_reason),
            device=self.config.device,
            spec_num_drafts=sched.num_drafts,
            spec_num_draft_tokens=sched.num_draft_tokens,
            spec_num_accepted_tokens=sched.num_accepted_tokens,
            spec_accepted_per_pos=list(sched.num_accepted_tokens_per_pos),
        )

    def _count_step_tokens(self, outputs: list[EngineCoreOutput]) -> int:
        """The tokens these outputs generated, plus the prompt of each request they carry the first token
        (or the end) of: a prefill step counts its prompts and their first tokens."""
        tokens = 0
        for out in outputs:
            if out.new_token_ids or out.finished:
                tokens += len(out.new_token_ids) + self._prompts_before_first_token.pop(out.request_id, 0)
        return tokens

    def take_step_tokens(self) -> list[int]:
        """Each step's token count since the last call (the first call starts the recording)."""
        tokens, self._step_tokens = self._step_tokens or [], []
        return tokens

    def drain_trace_events(self) -> list[TraceEvent]:
        events, self._trace_events = self._trace_events, []
        return events

    def shutdown(self) -> None:
        self.batch_queue.clear()
        if self.scheduler.structured_output_manager is not None:
            self.scheduler.structured_output_manager.shutdown()
        self.executor.shutdown()


def make_structured_output_manager(model_config: ModelConfig) -> StructuredOutputManager:
    """Grammars over the model's vocabulary; a complete grammar allows only the model's end tokens.
    The tokenizer loads on the first compile, off the engine's path."""
    from stepahead.models.loading.loader import load_tokenizer

    end_ids = [i for i in (model_config.eos_token_id, *model_config.extra_eos_token_ids) if i is not None]
    return StructuredOutputManager(functools.partial(load_tokenizer, model_config), model_config.vocab_size, end_ids)
