"""What both executors share: the worker's torch thread count and its busy-time accounting."""

from __future__ import annotations

import os
import time

from stepahead.core.sched_output import ModelRunnerOutput


def default_worker_threads(device: str) -> int:
    """Torch threads for the worker: every core but one, which is left to the engine's bookkeeping.

    Measured on the 2-core build machines (benchmarks/offline_throughput.py): with 2 threads the
    forward pass's OpenMP team competes with the engine thread or process for the cores, and steps
    slowed 4x (mp, built-in model) to 40x (uni, tiny model); 1 thread overlaps cleanly.
    """
    if device != "cpu":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


class StepTimer:
    """Sums the time a worker spends in the calls of one step; stamps it on the step's output.

    A step is execute_model (returning None) then sample_tokens, or execute_model alone when it
    returns an output directly. The runner may fill busy_s itself; then its value is kept.
    """

    def __init__(self) -> None:
        self._pending_s = 0.0

    def record(self, started: float, out: ModelRunnerOutput | None) -> ModelRunnerOutput | None:
        self._pending_s += time.perf_counter() - started
        if out is not None:
            if not out.busy_s:
                out.busy_s = self._pending_s
            self._pending_s = 0.0
        return out
