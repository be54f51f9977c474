"""UniProcExecutor: the ModelRunner in a thread of the engine process.

For debugging and for CUDA, where kernel launches are asynchronous anyway. On CPU a thread overlaps
little: the forward pass needs the GIL between its ops, and with many small ops a worker thread can
run slower than no overlap at all. That is why "mp" is the default there.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any

from stepahead.config import EngineConfig
from stepahead.executor.abstract import WorkerError
from stepahead.executor.common import default_worker_threads, load_runner
from stepahead.executor.output_resolver import OutputResolver
from stepahead.executor.submitting import SubmittingExecutor

_STOP = object()


class UniProcExecutor(SubmittingExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config
        self.num_threads = config.num_threads or default_worker_threads(config.device)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="stepahead-worker", daemon=True)
        self._thread.start()
        ready.result()  # re-raises a model-loading error here, in the caller

    # -- Executor API ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        if not self._pending.close():
            return
        self._calls.put(_STOP)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._pending.fail_after_close()

    # -- internals ------------------------------------------------------------------------------

    def _submit(self, method: str, arg: Any) -> Future:
        fut = self._pending.add()
        if not fut.done():
            self._calls.put((method, arg))
        return fut

    def _run(self, ready: Future) -> None:
        try:
            # The engine thread needs a core of its own while a step runs (see default_worker_threads).
            run_call = load_runner(self.config, self.num_threads)
        except BaseException as e:  # surfaced to the constructor's caller
            ready.set_exception(e)
            return
        self.num_kv_blocks = run_call.num_kv_blocks
        ready.set_result(None)
        resolver = None
        if self.config.async_output:  # outputs resolve in a thread of their own, in call order
            resolver = OutputResolver(lambda output: self._pending.resolve_oldest([output]),
                                      lambda e: self._fail("resolving a step's output", e))
        while True:
            item = self._calls.get()
            if item is _STOP:
                if resolver is not None:
                    resolver.close()
                return
            method, arg = item
            try:
                output = run_call(method, arg)
            except BaseException as e:  # every pending future learns of the failure
                self._fail(method, e)
                return
            if resolver is not None:
                resolver.put(output)
            else:
                self._pending.resolve_oldest([output])  # calls run in submission order

    def _fail(self, where: str, e: BaseException) -> None:
        err = WorkerError(f"stepahead worker raised in {where}: {e!r}")
        err.__cause__ = e
        self._pending.fail(err)
        self._notify_failure(self._pending.error or err)
