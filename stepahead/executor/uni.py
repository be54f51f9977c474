"""UniProcExecutor: the ModelRunner in a thread of the engine process.

For debugging and for CUDA, where kernel launches are asynchronous anyway. On CPU a thread overlaps
little (the forward pass needs the GIL between ops; see reference/environment.md), which is why
"mp" is the default there.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from stepahead.config import EngineConfig
from stepahead.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from stepahead.executor.abstract import Executor
from stepahead.executor.common import StepTimer, default_worker_threads

_STOP = object()


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.num_threads = config.num_threads or default_worker_threads(config.device, in_engine_process=True)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: deque[Future] = deque()  # submitted and not yet resolved, oldest first
        self._error: BaseException | None = None
        self._closed = False
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="stepahead-worker", daemon=True)
        self._thread.start()
        ready.result()  # re-raises a model-loading error here, in the caller

    # -- Executor API ---------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput | None]:
        return self._submit("execute_model", scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> Future[ModelRunnerOutput]:
        return self._submit("sample_tokens", grammar_output)

    def check_health(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"stepahead worker failed: {self._error!r}") from self._error

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._calls.put(_STOP)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._fail_pending(RuntimeError("stepahead executor was shut down"))

    # -- internals ------------------------------------------------------------------------------

    def _submit(self, method: str, arg: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._error is not None or self._closed:
                fut.set_exception(self._dead_error())
                return fut
            self._pending.append(fut)
        self._calls.put((method, arg, fut))
        return fut

    def _dead_error(self) -> RuntimeError:
        if self._closed:
            return RuntimeError("stepahead executor was shut down")
        return RuntimeError(f"stepahead worker failed earlier: {self._error!r}")

    def _run(self, ready: Future) -> None:
        try:
            import torch

            # Process-wide: the engine thread needs a core of its own while a step runs.
            torch.set_num_threads(self.num_threads)
            from stepahead.worker.model_runner import ModelRunner

            runner = ModelRunner(self.config)
        except BaseException as e:  # noqa: BLE001 - surfaced to the constructor's caller
            ready.set_exception(e)
            return
        ready.set_result(None)
        timer = StepTimer()
        calls: dict[str, Callable[[Any], ModelRunnerOutput | None]] = {
            "execute_model": runner.execute_model,
            "sample_tokens": runner.sample_tokens,
        }
        while True:
            item = self._calls.get()
            if item is _STOP:
                return
            method, arg, fut = item
            started = time.perf_counter()
            try:
                out = timer.record(started, calls[method](arg))
            except BaseException as e:  # noqa: BLE001 - every pending future learns of the failure
                self._error = e
                err = RuntimeError(f"stepahead worker raised in {method}: {e!r}")
                err.__cause__ = e
                self._fail_pending(err)
                return
            with self._lock:
                self._pending.popleft()  # calls run in submission order: fut is the oldest
            fut.set_result(out)

    def _fail_pending(self, err: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, deque()
        for fut in pending:
            if not fut.done():
                fut.set_exception(err)
