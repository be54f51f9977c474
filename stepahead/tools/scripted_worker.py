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

With num_speculative_tokens = k > 0 (given to the worker as a real one gets it from its config), the
worker proposes k drafts after every sample: a random-length run of the right tokens, then wrong
ones. A step that schedules drafts writes them into the KV cache after the last known token; the
verification accepts drafts while they equal the scripted tokens and adds the next scripted token,
so the output is the same as without drafts, and the rejected positions are rolled back on the
worker at once (as vLLM's runner corrects its positions before the next step). The scheduler's
counts run ahead by the rejections of steps it has not processed yet; the worker checks that gap.
Drafts are reported in draft_token_ids for the synchronous scheduler, which sends them back.

With a sliding window (as the scheduler's CacheConfig has it) a sampling step reads back only the
window of the step's first position, and a write into the null block (a block the scheduler
returned as out of the window) is an error.
"""

from __future__ import annotations

import queue
import random
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
    drafts: list[int] = field(default_factory=list)  # proposed after the last sample
    # Drafts rejected by the latest sampling steps, newest last: the scheduler's counts exceed the
    # worker's by the rejections of the steps it has not processed yet (a suffix of these).
    recent_rejections: list[int] = field(default_factory=list)

    def unprocessed_rejections(self) -> set[int]:
        sums, total = {0}, 0
        for rejected in reversed(self.recent_rejections):
            total += rejected
            sums.add(total)
        return sums


class ScriptedWorker:
    def __init__(self, model: ScriptedModel, block_size: int, num_blocks: int, verify_kv: bool = True,
                 num_speculative_tokens: int = 0, draft_seed: int = 0, sliding_window: int | None = None) -> None:
        self.model = model
        self.sliding_window = sliding_window
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_rng = random.Random(draft_seed)
        self.block_size = block_size
        self.verify_kv = verify_kv
        self.kv: list[tuple[int, int] | None] = [None] * (block_size * num_blocks)
        self.states: dict[str, _ReqState] = {}
        # (req id, samples, drafts, first position) of the executed step's rows
        self._pending: list[tuple[str, bool, int, int]] | None = None
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
        rows: list[tuple[str, bool, int, int]] = []
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self.states.get(rid)
            if state is None:
                raise WorkerStateError(f"step {scheduler_output.step_id} schedules unknown request {rid}")
            drafts = self._scheduled_drafts(rid, state, spec_tokens.get(rid, []))
            known = state.token_ids + drafts
            start = state.num_computed_tokens
            if start + num_scheduled > len(known):
                raise WorkerStateError(
                    f"{rid}: positions {start}..{start + num_scheduled - 1} scheduled, but the worker knows only "
                    f"{len(known)} tokens (a placeholder it cannot fill)")
            for pos in range(start, start + num_scheduled):
                self._write_kv(rid, pos, known[pos], state)
            state.num_computed_tokens = start + num_scheduled
            samples = state.num_computed_tokens == len(known)
            if drafts and not samples:
                raise WorkerStateError(f"{rid}: drafts scheduled in a step that does not reach them")
            rows.append((rid, samples, len(drafts), start))
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
        draft_token_ids: dict[str, list[int]] = {}
        for rid, samples, num_drafts, first_pos in rows:
            state = self.states[rid]
            req_ids.append(rid)
            if not samples:  # partial prefill: the sample is discarded
                sampled.append([])
                continue
            tokens = self._verify(rid, state, num_drafts)
            if self.verify_kv:
                self._verify_context(rid, state, first_pos)
            state.token_ids.append(tokens[-1])
            sampled.append(tokens)
            if self.num_speculative_tokens:
                state.drafts = self._propose(rid, state)
                draft_token_ids[rid] = list(state.drafts)
        return ModelRunnerOutput(req_ids, sampled, draft_token_ids=draft_token_ids)

    def _scheduled_drafts(self, rid: str, state: _ReqState, scheduled: list[int]) -> list[int]:
        """This step's drafts: the worker's own (async sends -1 placeholders; sync sends them back)."""
        if not scheduled:
            return []
        drafts = state.drafts[:len(scheduled)]
        if len(drafts) < len(scheduled):
            raise WorkerStateError(f"{rid}: {len(scheduled)} drafts scheduled, {len(state.drafts)} proposed")
        if any(d != -1 for d in scheduled) and list(scheduled) != drafts:
            raise WorkerStateError(f"{rid}: scheduled drafts {scheduled} are not the proposed {drafts}")
        return drafts

    def _verify(self, rid: str, state: _ReqState, num_drafts: int) -> list[int]:
        """Greedy verification: accepted drafts join the context (their KV is written); then the token
        after them. Rejected positions are rolled back."""
        num_output = len(state.token_ids) - state.prompt_len
        accepted: list[int] = []
        for j, draft in enumerate(state.drafts[:num_drafts]):
            if draft != self.model.token(rid, num_output + j):
                break
            accepted.append(draft)
        state.token_ids.extend(accepted)
        rejected = num_drafts - len(accepted)
        state.num_computed_tokens -= rejected
        if self.num_speculative_tokens:
            state.recent_rejections = (state.recent_rejections + [rejected])[-4:]
        return accepted + [self.model.token(rid, num_output + len(accepted))]

    def _propose(self, rid: str, state: _ReqState) -> list[int]:
        """k drafts: a random number of right tokens, then wrong ones."""
        k = self.num_speculative_tokens
        num_right = self.draft_rng.randint(0, k)
        num_output = len(state.token_ids) - state.prompt_len
        span = self.model.vocab_size - 3
        drafts = []
        for j in range(k):
            token_id = self.model.token(rid, num_output + j)
            drafts.append(token_id if j < num_right else 3 + (token_id - 2) % span)
        return drafts

    def _update_cached(self, rid: str, k: int, cached: CachedRequestData) -> None:
        state = self.states.get(rid)
        resumed = rid in cached.resumed_req_ids
        all_ids = cached.all_token_ids.get(rid)
        if state is None and all_ids is None:
            raise WorkerStateError(f"cached request {rid} unknown to the worker and sent without history")
        num_output = cached.num_output_tokens[k]
        if state is None:
            raise WorkerStateError(f"{rid}: history resent for a request the worker never saw")
        ahead = 0  # the scheduler's counts include rejections of steps it has not processed
        if resumed:
            state.drafts, state.recent_rejections = [], []
        else:
            ahead = cached.num_computed_tokens[k] - state.num_computed_tokens
            if ahead not in state.unprocessed_rejections():
                raise WorkerStateError(f"{rid}: worker computed {state.num_computed_tokens}, scheduler says "
                                       f"{cached.num_computed_tokens[k]}")
        num_output -= ahead
        if all_ids is not None:
            common = min(len(all_ids), len(state.token_ids))
            if state.token_ids[:common] != all_ids[:common]:
                raise WorkerStateError(f"{rid}: scheduler history disagrees with the worker's")
            # The longer history holds the other. Trim it to what the scheduler counts (real outputs
            # plus placeholders): anything past that was sampled by a step whose output it dropped.
            longer = state.token_ids if len(state.token_ids) >= len(all_ids) else all_ids
            state.token_ids = list(longer[:state.prompt_len + num_output])
        if len(state.token_ids) - state.prompt_len != num_output:
            raise WorkerStateError(f"{rid}: worker holds {len(state.token_ids) - state.prompt_len} output tokens, "
                                   f"scheduler counts {num_output} (real + placeholders)")
        new_blocks = cached.new_block_ids[k]
        if resumed:
            state.block_ids = list(new_blocks or [])
        elif new_blocks:
            state.block_ids.extend(new_blocks)
        state.num_computed_tokens = cached.num_computed_tokens[k] - ahead

    def _slot(self, rid: str, state: _ReqState, pos: int) -> int:
        block_index = pos // self.block_size
        if block_index >= len(state.block_ids):
            raise WorkerStateError(f"{rid}: no block for position {pos} (table {state.block_ids})")
        return state.block_ids[block_index] * self.block_size + pos % self.block_size

    def _write_kv(self, rid: str, pos: int, token_id: int, state: _ReqState) -> None:
        slot = self._slot(rid, state, pos)
        if slot < self.block_size:
            raise WorkerStateError(f"{rid}: position {pos} written into the null block (table {state.block_ids})")
        self.kv[slot] = (token_id, pos)

    def _verify_context(self, rid: str, state: _ReqState, first_pos: int) -> None:
        """Every position the step's attention reads: all before it, or the window of its first position."""
        start = 0 if self.sliding_window is None else max(0, first_pos - self.sliding_window + 1)
        for pos in range(start, len(state.token_ids)):
            token_id = state.token_ids[pos]
            got = self.kv[self._slot(rid, state, pos)]
            if got != (token_id, pos):
                raise WorkerStateError(f"{rid}: KV at position {pos} holds {got}, expected {(token_id, pos)}")


class ScriptedExecutor(Executor):
    """ScriptedWorker in a real worker thread; calls are served strictly in submission order."""

    def __init__(self, model: ScriptedModel, block_size: int, num_blocks: int, *, verify_kv: bool = True,
                 step_delay_s: float = 0.0, fail_at_step: int | None = None,
                 on_step: Callable[[ScriptedWorker], None] | None = None, num_speculative_tokens: int = 0,
                 draft_seed: int = 0, sliding_window: int | None = None) -> None:
        self.worker = ScriptedWorker(model, block_size, num_blocks, verify_kv, num_speculative_tokens, draft_seed,
                                     sliding_window)
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
