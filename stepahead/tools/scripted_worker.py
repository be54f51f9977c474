"""A scripted model behind the real Executor interface: no torch, deterministic tokens.

ScriptedWorker keeps per-request state from SchedulerOutput diffs exactly as a real model runner
must: it substitutes its own last sampled token for the scheduler's placeholder, rebuilds resumed
requests from all_token_ids with a replaced block table, and keeps an emulated KV cache (token id
and position per slot) that every sampling step reads back through the block table. Any
disagreement (a placeholder it cannot fill, a history that differs from the scheduler's, KV content
that is not this request's context) raises WorkerStateError, which fails the step's future.

The sampled token is a pure function of (request id, output index), with end-of-sequence at a
scripted 1-based output position, so async, sync, preempted and prefix-cached runs must all agree.
ScriptedExecutor runs the worker in a real thread and answers with real futures.
"""

from __future__ import annotations

import queue
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from stepahead.core.sched_output import CachedRequestData, GrammarOutput, ModelRunnerOutput, SchedulerOutput
from stepahead.executor.abstract import Executor
from stepahead.tracing import TraceEvent


class WorkerStateError(RuntimeError):
    pass


@dataclass
class ScriptedModel:
    """token(rid, j) for output index j (0-based); eos_at(rid) is a 1-based position, 0 = never."""

    eos_token_id: int = 2
    vocab_size: int = 1000
    eos_at: dict[str, int] = field(default_factory=dict)
    default_eos_at: int = 0

    def token(self, req_id: str, output_index: int) -> int:
        if output_index + 1 == self.eos_at.get(req_id, self.default_eos_at):
            return self.eos_token_id
        span = self.vocab_size - 3  # ids 0..2 are special; 2 is EOS
        return 3 + (zlib.crc32(req_id.encode()) * 31 + output_index * 7919) % span


@dataclass
class _ReqState:
    prompt_len: int
    token_ids: list[int]  # prompt + every token this worker sampled (or was sent)
    block_ids: list[int]
    num_computed_tokens: int


class ScriptedWorker:
    def __init__(self, model: ScriptedModel, block_size: int, num_blocks: int, verify_kv: bool = True) -> None:
        self.model = model
        self.block_size = block_size
        self.verify_kv = verify_kv
        self.kv: list[tuple[int, int] | None] = [None] * (block_size * num_blocks)
        self.states: dict[str, _ReqState] = {}
        self._pending: list[tuple[str, bool]] | None = None  # (req id, samples) of the executed step
        self.num_steps = 0

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        if self._pending is not None:
            raise WorkerStateError("execute_model before the previous step was sampled")
        for rid in scheduler_output.finished_req_ids:
            self.states.pop(rid, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.states[new.req_id] = _ReqState(len(new.prompt_token_ids), list(new.prompt_token_ids),
                                                list(new.block_ids), new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for k, rid in enumerate(cached.req_ids):
            self._update_cached(rid, k, cached)
        rows: list[tuple[str, bool]] = []
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self.states.get(rid)
            if state is None:
                raise WorkerStateError(f"step {scheduler_output.step_id} schedules unknown request {rid}")
            start = state.num_computed_tokens
            if start + num_scheduled > len(state.token_ids):
                raise WorkerStateError(
                    f"{rid}: positions {start}..{start + num_scheduled - 1} scheduled, but the worker knows only "
                    f"{len(state.token_ids)} tokens (a placeholder it cannot fill)")
            for pos in range(start, start + num_scheduled):
                self._write_kv(rid, state, pos)
            state.num_computed_tokens = start + num_scheduled
            rows.append((rid, state.num_computed_tokens == len(state.token_ids)))
        if not rows:
            return ModelRunnerOutput.empty()
        self._pending = rows
        self.num_steps += 1
        return None

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        if self._pending is None:
            raise WorkerStateError("sample_tokens without an executed step")
        rows, self._pending = self._pending, None
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for rid, samples in rows:
            state = self.states[rid]
            req_ids.append(rid)
            if not samples:  # partial prefill: the sample is discarded
                sampled.append([])
                continue
            if self.verify_kv:
                self._verify_context(rid, state)
            token_id = self.model.token(rid, len(state.token_ids) - state.prompt_len)
            state.token_ids.append(token_id)
            sampled.append([token_id])
        return ModelRunnerOutput(req_ids, sampled)

    def _update_cached(self, rid: str, k: int, cached: CachedRequestData) -> None:
        state = self.states.get(rid)
        resumed = rid in cached.resumed_req_ids
        all_ids = cached.all_token_ids.get(rid)
        if state is None and all_ids is None:
            raise WorkerStateError(f"cached request {rid} unknown to the worker and sent without history")
        num_output = cached.num_output_tokens[k]
        if state is None:
            raise WorkerStateError(f"{rid}: history resent for a request the worker never saw")
        if all_ids is not None:
            common = min(len(all_ids), len(state.token_ids))
            if state.token_ids[:common] != all_ids[:common]:
                raise WorkerStateError(f"{rid}: scheduler history disagrees with the worker's")
            # The longer history holds the other. Trim it to what the scheduler counts (real outputs
            # plus placeholders): anything past that was sampled by a step whose output it dropped.
            longer = state.token_ids if len(state.token_ids) >= len(all_ids) else all_ids
            state.token_ids = list(longer[:state.prompt_len + num_output])
        if not resumed and state.num_computed_tokens != cached.num_computed_tokens[k]:
            raise WorkerStateError(f"{rid}: worker computed {state.num_computed_tokens}, scheduler says "
                                   f"{cached.num_computed_tokens[k]}")
        if len(state.token_ids) - state.prompt_len != num_output:
            raise WorkerStateError(f"{rid}: worker holds {len(state.token_ids) - state.prompt_len} output tokens, "
                                   f"scheduler counts {num_output} (real + placeholders)")
        new_blocks = cached.new_block_ids[k]
        if resumed:
            state.block_ids = list(new_blocks or [])
        elif new_blocks:
            state.block_ids.extend(new_blocks)
        state.num_computed_tokens = cached.num_computed_tokens[k]

    def _slot(self, rid: str, state: _ReqState, pos: int) -> int:
        block_index = pos // self.block_size
        if block_index >= len(state.block_ids):
            raise WorkerStateError(f"{rid}: no block for position {pos} (table {state.block_ids})")
        return state.block_ids[block_index] * self.block_size + pos % self.block_size

    def _write_kv(self, rid: str, state: _ReqState, pos: int) -> None:
        self.kv[self._slot(rid, state, pos)] = (state.token_ids[pos], pos)

    def _verify_context(self, rid: str, state: _ReqState) -> None:
        for pos, token_id in enumerate(state.token_ids):
            got = self.kv[self._slot(rid, state, pos)]
            if got != (token_id, pos):
                raise WorkerStateError(f"{rid}: KV at position {pos} holds {got}, expected {(token_id, pos)}")


class ScriptedExecutor(Executor):
    """ScriptedWorker in a real worker thread; calls are served strictly in submission order."""

    def __init__(self, model: ScriptedModel, block_size: int, num_blocks: int, *, verify_kv: bool = True,
                 step_delay_s: float = 0.0, fail_at_step: int | None = None,
                 on_step: Callable[[ScriptedWorker], None] | None = None) -> None:
        self.worker = ScriptedWorker(model, block_size, num_blocks, verify_kv)
        self.step_delay_s = step_delay_s
        self.fail_at_step = fail_at_step
        self.on_step = on_step
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="scripted-worker", daemon=True)
        self._thread.start()

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput | None]:
        return self._submit(self._execute, scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> Future[ModelRunnerOutput]:
        return self._submit(self._sample, grammar_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        if self.fail_at_step is not None and self.worker.num_steps + 1 >= self.fail_at_step \
                and scheduler_output.total_num_scheduled_tokens > 0:
            raise RuntimeError(f"scripted worker failure at step {self.worker.num_steps + 1}")
        return self.worker.execute_model(scheduler_output)

    def _sample(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        start = time.monotonic()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        out = self.worker.sample_tokens(grammar_output)
        end = time.monotonic()
        out.busy_s = out.gpu_busy_s = end - start  # the scripted worker stands for host and device alike
        out.trace_events = [TraceEvent("sample_tokens", "worker", start, end, {"num_reqs": len(out.req_ids)})]
        if self.on_step is not None:
            self.on_step(self.worker)
        return out

    def _submit(self, fn, arg) -> Future:
        future: Future = Future()
        self._queue.put((fn, arg, future))
        return future

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, arg, future = item
            if self._error is not None:  # a dead worker fails every later call too
                future.set_exception(RuntimeError(f"worker is dead: {self._error!r}"))
                continue
            try:
                future.set_result(fn(arg))
            except BaseException as e:  # reported through the future
                self._error = e
                future.set_exception(e)

    def check_health(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"scripted worker died: {self._error!r}")

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
