"""What the executors share: the worker's torch threads, its busy-time accounting, and
starting a spawned process without re-running the caller's script (also used by AsyncLLM)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator

from stepahead.core.sched_output import ModelRunnerOutput


def default_worker_threads(device: str) -> int:
    """Torch threads for the worker: every core but one, which is left to the engine's bookkeeping.

    A per-machine choice (reference/environment.md), measured on the 2-core build machine with
    nothing else running (`stepahead bench throughput --num-threads N`, runs taking turns):
    - mp, built-in model, 64 requests (input 32-64, output 16-24): 1 thread 16.7 s and 14.7 s,
      2 threads 69.6 s and 34.8 s. The tiny model of docs/BENCHMARKS.md section 2: 2.5 s vs 38 s.
      The OpenMP team's second thread shares its core with the engine process, and every parallel
      region waits for it.
    - uni (the worker is a thread of the engine process), tiny model: 3.8 vs 5.8 ms per step, and
      50x slower under outside load: the team and the engine thread also fight over the GIL.
    An earlier run on a busy machine had 2 mp threads 21% ahead on the built-in model (32 requests);
    the quiet-machine runs above reverse that by 2-15x, so both executors leave a core free.
    """
    if device != "cpu":
        return 1
    return max(1, len(_allowed_cores()) - 1)


def _allowed_cores() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


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


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Keep spawn from re-running the caller's main script in a child process.

    spawn re-imports `__main__` in the child, so a script calling LLM() at top level without an
    `if __name__ == "__main__":` guard would start a second engine there. The worker and the engine
    process need nothing from the caller's script, so the main module's file and spec are hidden
    while the process starts.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        for k in saved:
            if k == "__file__":
                del main.__dict__[k]
            else:
                main.__dict__[k] = None
        yield
    finally:
        for k, v in saved.items():
            main.__dict__[k] = v
