"""EngineCore: the step function over a scheduler, an executor and a batch queue (engine-spec §1.5).

With max_concurrent_batches == 1, step() schedules, runs and processes one step at a time. Above
that, step_with_batch_queue() keeps up to that many steps in flight: it schedules step N+1 and
starts it before blocking on step N's output.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from stepahead.config import EngineConfig
from stepahead.core.async_scheduler import AsyncScheduler
from stepahead.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from stepahead.core.scheduler import Scheduler
from stepahead.errors import EngineDeadError
from stepahead.executor.abstract import Executor
from stepahead.outputs import EngineStats
from stepahead.request import Request, RequestStatus

_HEALTH_POLL_S = 1.0  # how often a blocked wait asks the executor whether its worker is alive


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        sched_cls = AsyncScheduler if config.async_scheduling else Scheduler
        self.scheduler: Scheduler = sched_cls(config.scheduler_config, config.cache_config)
        self.executor = executor
        self.batch_queue_size = config.max_concurrent_batches
        # (sample future, scheduler output, execute future), newest on the left.
        self.batch_queue: deque[tuple[Future, SchedulerOutput, Future]] = deque()
        self._step_fn = self._step if self.batch_queue_size == 1 else self._step_with_batch_queue
        self._aborts: list[str] = []
        self._aborts_lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._dead: str | None = None
        self._trace = config.trace
        self._trace_events: list[dict] = []
        # Statistics.
        self._forward_steps = 0
        self._busy_s = 0.0
        self._wall_s = 0.0
        self._work_since: float | None = None
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished_by_reason: dict[str, int] = {}

    # -- requests ----------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._check_alive()
        with self._step_lock:
            self.scheduler.add_request(request)
        self._prompt_tokens += request.num_prompt_tokens

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
        live = [rid for rid in ids if rid in self.scheduler.requests]
        self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        if live:
            self._finished_by_reason["abort"] = self._finished_by_reason.get("abort", 0) + len(live)

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
                outputs = self._step_fn()
            except EngineDeadError:
                raise
            except Exception as e:  # noqa: BLE001 - any executor failure kills the engine
                raise self._die(e) from e
            for o in outputs:
                self._generation_tokens += len(o.new_token_ids)
                if o.finish_reason is not None:
                    self._finished_by_reason[o.finish_reason] = self._finished_by_reason.get(o.finish_reason, 0) + 1
            if not self.has_work():
                self._wall_s += time.monotonic() - self._work_since
                self._work_since = None
            return outputs

    def _step(self) -> list[EngineCoreOutput]:
        self._process_aborts()  # nothing is in flight between synchronous steps
        if not self.scheduler.has_requests():
            return []
        so = self._schedule()
        exec_fut = self.executor.execute_model(so)
        grammar = self.scheduler.get_grammar_bitmask(so)  # on the CPU while the forward pass runs
        out = self._wait(exec_fut)
        if out is None:
            out = self._wait(self.executor.sample_tokens(grammar))
        self._process_aborts()
        return self._update(so, out)

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        queue = self.batch_queue
        deferred: SchedulerOutput | None = None
        exec_fut: Future | None = None
        if not queue:
            self._process_aborts()
        if self.scheduler.has_requests():
            so = self._schedule()
            exec_fut = self.executor.execute_model(so)
            executed = so.total_num_scheduled_tokens > 0
            if not executed:
                fut = exec_fut
            elif not so.pending_structured_output_tokens or not queue:
                fut = self.executor.sample_tokens(self.scheduler.get_grammar_bitmask(so))
            else:
                # The grammar must first see the previous step's token: sample after processing it.
                deferred = so
            if deferred is None:
                queue.appendleft((fut, so, exec_fut))
                if len(queue) < self.batch_queue_size and (executed or self.scheduler.has_requests()):
                    return []
        elif not queue:
            return []
        fut, so_old, exec_old = queue.pop()
        out = self._wait(fut)
        if fut is not exec_old:
            self._wait(exec_old)  # surfaces a forward-pass failure
        self._process_aborts()
        outputs = self._update(so_old, out)
        if deferred is not None:
            fut = self.executor.sample_tokens(self.scheduler.get_grammar_bitmask(deferred))
            queue.appendleft((fut, deferred, exec_fut))
        return outputs

    def _schedule(self) -> SchedulerOutput:
        t0 = time.monotonic()
        so = self.scheduler.schedule()
        if self._trace:
            self._trace_events.append({"name": "schedule", "lane": "engine", "start": t0, "end": time.monotonic(),
                                       "args": {"step": so.step_id, "tokens": so.total_num_scheduled_tokens,
                                                "reqs": len(so.num_scheduled_tokens)}})
        return so

    def _update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        t0 = time.monotonic()
        outputs = self.scheduler.update_from_output(so, out)
        if so.total_num_scheduled_tokens > 0:
            self._forward_steps += 1
        self._busy_s += out.busy_s
        if self._trace:
            self._trace_events.extend(out.trace_events)
            self._trace_events.append({"name": "update_from_output", "lane": "engine", "start": t0,
                                       "end": time.monotonic(),
                                       "args": {"step": so.step_id, "outputs": len(outputs)}})
        return outputs

    def _wait(self, fut: Future):
        """Block on a worker future without hanging on a dead worker."""
        while True:
            try:
                return fut.result(timeout=_HEALTH_POLL_S)
            except FutureTimeout:
                self.executor.check_health()

    # -- failure -----------------------------------------------------------------------------------

    def _die(self, cause: BaseException) -> EngineDeadError:
        self._dead = f"engine core died: executor failed with {cause!r}"
        sched = self.scheduler
        ids = list(sched.requests)
        sched.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        self.batch_queue.clear()
        if ids:
            self._finished_by_reason["error"] = self._finished_by_reason.get("error", 0) + len(ids)
        if self._work_since is not None:
            self._wall_s += time.monotonic() - self._work_since
            self._work_since = None
        return EngineDeadError(self._dead, [EngineCoreOutput(rid, [], "error") for rid in ids])

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    # -- stats and traces --------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        sched = self.scheduler
        kv = sched.kv_cache_manager
        wall = self._wall_s + (time.monotonic() - self._work_since if self._work_since is not None else 0.0)
        return EngineStats(
            forward_steps=self._forward_steps,
            wasted_request_steps=sched.num_wasted_request_steps,
            busy_s=self._busy_s,
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
        )

    def drain_trace_events(self) -> list[dict]:
        events, self._trace_events = self._trace_events, []
        return events

    def shutdown(self) -> None:
        self.batch_queue.clear()
        self.executor.shutdown()
