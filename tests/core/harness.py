"""Drives the torch-free scheduler with the scripted worker, with a batch queue of a chosen depth.

Every schedule/process checks the invariants (docs/design.md, "Invariants") and records what was
delivered, so a test only states the scenario and its expected counters.
"""

from __future__ import annotations

from collections import defaultdict, deque

from stepahead.config import CacheConfig, SchedulerConfig
from stepahead.core.async_scheduler import AsyncScheduler
from stepahead.core.invariants import check_after_schedule, check_scheduler
from stepahead.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from stepahead.core.scheduler import Scheduler
from stepahead.request import Request
from stepahead.sampling_params import SamplingParams
from stepahead.tools.scripted_worker import ScriptedModel, ScriptedWorker

EOS = 2


class Harness:
    def __init__(self, *, is_async: bool = True, depth: int | None = None, block_size: int = 4,
                 num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 16, max_model_len: int = 128,
                 caching: bool = True, eos_at: dict[str, int] | None = None,
                 chunked: bool = True, num_spec_tokens: int = 0, draft_seed: int = 0,
                 sliding_window: int | None = None, scheduling_policy: str = "fcfs") -> None:
        cls = AsyncScheduler if is_async else Scheduler
        self.sched: Scheduler = cls(
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                            max_model_len=max_model_len, enable_chunked_prefill=chunked,
                            num_speculative_tokens=num_spec_tokens, scheduling_policy=scheduling_policy),
            CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching,
                        sliding_window=sliding_window))
        self.depth = depth if depth is not None else (2 if is_async else 1)
        self.model = ScriptedModel(eos_token_id=EOS, eos_at=dict(eos_at or {}))
        self.worker = ScriptedWorker(self.model, block_size, num_blocks, num_speculative_tokens=num_spec_tokens,
                                     draft_seed=draft_seed, sliding_window=sliding_window)
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.delivered: dict[str, list[int]] = defaultdict(list)
        self.finished: dict[str, EngineCoreOutput] = {}
        self.outputs: list[EngineCoreOutput] = []

    def add(self, rid: str, prompt: list[int], max_tokens: int | None = 8, eos_at: int | None = None,
            priority: int = 0, **params) -> Request:
        if eos_at is not None:
            self.model.eos_at[rid] = eos_at
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_id=EOS,
                      max_model_len=self.sched.max_model_len, priority=priority)
        self.sched.add_request(req)
        self.finished.pop(rid, None)
        self.delivered.pop(rid, None)
        return req

    def schedule(self) -> SchedulerOutput:
        so = self.sched.schedule()
        check_after_schedule(self.sched, so)
        out = self.worker.execute_model(so)
        if out is None:
            out = self.worker.sample_tokens(None)
        self.in_flight.append((so, out))
        check_scheduler(self.sched, [s for s, _ in self.in_flight])
        return so

    def process(self, out: ModelRunnerOutput | None = None) -> list[EngineCoreOutput]:
        so, real = self.in_flight.popleft()
        outs = self.sched.update_from_output(so, out if out is not None else real)
        for o in outs:
            assert o.request_id not in self.finished, f"delivered after finish: {o}"
            self.delivered[o.request_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finished[o.request_id] = o
        self.outputs.extend(outs)
        check_scheduler(self.sched, [s for s, _ in self.in_flight])
        return outs

    def step(self) -> list[EngineCoreOutput]:
        """One engine iteration with a batch queue of self.depth, as EngineCore runs it."""
        if self.sched.has_requests():
            so = self.schedule()
            if len(self.in_flight) < self.depth and (so.total_num_scheduled_tokens or self.sched.has_requests()):
                return []
        if not self.in_flight:
            return []
        return self.process()

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not (self.sched.has_requests() or self.in_flight):
                return
            self.step()
        raise AssertionError("scheduler made no progress (liveness)")

    def expected_tokens(self, rid: str, n: int) -> list[int]:
        return [self.model.token(rid, j) for j in range(n)]
