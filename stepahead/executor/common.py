"""What both executors share: the worker's torch thread count and its busy-time accounting."""

from __future__ import annotations

import os
import time

from stepahead.core.sched_output import ModelRunnerOutput


def default_worker_threads(device: str, in_engine_process: bool) -> int:
    """Torch threads for the worker; a per-machine choice (reference/environment.md), measured here.

    2-core build machine, benchmarks/offline_throughput.py, configurations taking turns:
    - mp, built-in model, 32 requests: 2 threads beat 1 by 21% (median of 3 rounds: 171 vs 208 ms
      per step, async); the engine process needs little CPU next to a 100+ ms forward pass.
    - uni (the worker is a thread of the engine process), tiny model: 1 thread beat 2 (3.8 vs 5.8 ms
      per step), and under heavy load from other processes 2 threads collapsed (50x slower): the
      forward's OpenMP team and the engine thread fight over the cores and the GIL. So uni leaves a
      core to the engine.
    A run of mp with 2 threads under heavy outside load took 3.5x longer per step than 1 thread had
    minutes before: on a busy machine pass num_threads=1.
    """
    if device != "cpu":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1) if in_engine_process else cores


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
