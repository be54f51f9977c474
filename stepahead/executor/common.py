"""What the executors' workers share: their torch threads, and serving calls on a model runner."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from stepahead.config import EngineConfig
from stepahead.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from stepahead.worker.async_output import AsyncModelRunnerOutput

# The calls an executor sends its worker, by name (the mp executor sends the name down its pipe).
RUNNER_METHODS = ("execute_model", "sample_tokens")


def default_worker_threads(device: str, passive_wait: bool = False) -> int:
    """Torch threads for the worker: every core when its OpenMP threads wait passively (the mp
    worker, spawned with OMP_WAIT_POLICY=PASSIVE: executor/spawn.py), else every core but one.

    Why (figures in docs/BENCHMARKS.md, sections 7 and 14.3): on a quiet machine every core serves
    the model faster than one. Under load (another process busy on a core) spinning OpenMP threads
    make a parallel region wait for the thread that lost its core, many times slower than one
    thread; waiting passively, extra threads cost little there. Where waiting cannot be made passive
    (uni: the worker is a thread of the engine process, whose OpenMP runtime started before; or
    OMP_WAIT_POLICY set to something else by the user) one core is left to the engine.
    """
    if device != "cpu":
        return 1
    cores = len(_allowed_cores())
    return cores if passive_wait else max(1, cores - 1)


def _allowed_cores() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


class StepRunner(Protocol):
    """What a worker serves: the two calls of a step (ModelRunner, or a scripted stand-in)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None: ...

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput | AsyncModelRunnerOutput: ...


class StepTimer:
    """Sums the time a worker spends in the calls of one step; stamps it on the step's output.

    A step is execute_model (returning None) then sample_tokens, or execute_model alone when it
    returns an output directly. The runner may fill busy_s itself; then its value is kept.
    """

    def __init__(self) -> None:
        self._pending_s = 0.0

    def record(self, started: float, output: ModelRunnerOutput | None) -> ModelRunnerOutput | None:
        self._pending_s += time.perf_counter() - started
        if output is not None:
            if isinstance(output, ModelRunnerOutput) and not output.busy_s:  # an async output has its own
                output.busy_s = self._pending_s
            self._pending_s = 0.0
        return output


class RunnerCalls:
    """The worker's side of an executor: a call by method name, run on the runner and timed."""

    def __init__(self, runner: StepRunner) -> None:
        self._methods: dict[str, Callable[[Any], ModelRunnerOutput | None]] = {
            name: getattr(runner, name) for name in RUNNER_METHODS
        }
        self._timer = StepTimer()
        self.num_kv_blocks: int | None = getattr(runner, "num_kv_blocks", None)
        # Only the sampler rank's outputs go back to the engine; other ranks report only failures.
        self.reports_outputs = True

    def __call__(self, method: str, arg: Any) -> ModelRunnerOutput | None:
        started = time.perf_counter()
        return self._timer.record(started, self._methods[method](arg))


@dataclass(frozen=True)
class RankSpec:
    """One worker rank of a tensor/pipeline-parallel model, and where the ranks meet (a TCP store)."""

    rank: int
    master_addr: str
    master_port: int


def load_runner(config: EngineConfig, num_threads: int, rank: RankSpec | None = None) -> RunnerCalls:
    """Set the process's torch threads, join the other ranks (if any), load the model, and serve calls on it."""
    import torch

    torch.set_num_threads(num_threads)  # process-wide: for uni the engine thread shares this process
    from stepahead.worker.model_runner import ModelRunner

    if rank is None:
        return RunnerCalls(ModelRunner(config))
    from stepahead.distributed.state import init_parallel_state

    p = config.parallel_config
    ps = init_parallel_state(rank.rank, p.tensor_parallel_size, p.pipeline_parallel_size, rank.master_addr,
                             rank.master_port, config.device, p.pp_layer_partition)
    calls = RunnerCalls(ModelRunner(config, ps))
    calls.reports_outputs = ps.is_sampler
    return calls
