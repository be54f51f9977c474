"""MultiprocExecutor: the ModelRunner in a spawned worker process.

On CPU only a separate process truly overlaps the engine's Python bookkeeping with the forward pass:
measured on a 2-core machine with 1 torch thread, a worker process hid the bookkeeping almost fully
(1.27-1.49x the sequential speed at batch 1-16), while a worker thread was often slower than no
overlap at all (see uni.py). Calls go down one pipe in order; a reader thread takes the results off
the other pipe and resolves the oldest pending futures with them. The reader also watches the process
sentinel, so a worker that dies resolves every pending future with an error instead of a hang, and
calls the notify_on_failure callback, so an engine with no call pending (idle) learns of it too.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
from concurrent.futures import Future
from multiprocessing.connection import wait
from typing import Any

from stepahead.config import EngineConfig
from stepahead.executor.abstract import WorkerError
from stepahead.executor.common import default_worker_threads
from stepahead.executor.spawn import (
    exit_text,
    main_module_hidden,
    stop_process,
    worker_environment,
    worker_waits_passively,
)
from stepahead.executor.submitting import SubmittingExecutor
from stepahead.executor.worker_proc import worker_main

_SHUTDOWN_GRACE_S = 5.0


class MultiprocExecutor(SubmittingExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config
        # All cores: the worker's OpenMP threads wait passively (spawn.WORKER_OMP_ENV).
        self.num_threads = config.num_threads or default_worker_threads(config.device, worker_waits_passively())
        spawn = multiprocessing.get_context("spawn")
        worker_calls, self._calls = spawn.Pipe(duplex=False)
        self._results, worker_results = spawn.Pipe(duplex=False)
        self._proc = spawn.Process(target=worker_main, name="stepahead-worker", daemon=True,
                                   args=(config, self.num_threads, worker_calls, worker_results))
        with main_module_hidden(), worker_environment():
            self._proc.start()
        # Only the worker holds these ends now, so its exit closes them.
        worker_calls.close()
        worker_results.close()
        self._send_lock = threading.Lock()
        try:
            self._wait_ready()
        except BaseException:
            self._stop_process()
            raise
        self._reader = threading.Thread(target=self._read_results, name="stepahead-executor-reader", daemon=True)
        self._reader.start()

    # -- Executor API ---------------------------------------------------------------------------

    def check_health(self) -> None:
        super().check_health()
        if not self._pending.closed and not self._proc.is_alive():
            raise WorkerError(self._death_message())

    @property
    def worker_pid(self) -> int | None:
        return self._proc.pid

    def shutdown(self) -> None:
        if not self._pending.close():
            return
        with self._send_lock, contextlib.suppress(OSError, ValueError):
            self._calls.send(("shutdown", None))
        self._stop_process()
        self._pending.fail_after_close()

    # -- internals ------------------------------------------------------------------------------

    def _submit(self, method: str, arg: Any) -> Future:
        # _send_lock keeps calls in the order of their futures. The send itself holds no lock of
        # PendingCalls: a call larger than the pipe buffer blocks until the worker reads it, and the
        # reader thread must meanwhile be free to resolve results from the other pipe.
        with self._send_lock:
            fut = self._pending.add()
            if fut.done():
                return fut
            try:
                self._calls.send((method, arg))
                return fut
            except (OSError, ValueError) as e:  # broken pipe: the worker is gone
                err = WorkerError(f"{self._death_message()} (sending {method} failed: {e!r})")
        self._pending.fail(err)
        return fut

    def _recv_result(self) -> tuple[str, Any]:
        """One (kind, payload) message from the worker; ("died", None) when its pipe is gone."""
        try:
            return self._results.recv()
        except (EOFError, OSError):
            return "died", None

    def _wait_ready(self) -> None:
        while True:
            ready = wait([self._results, self._proc.sentinel])
            if self._results in ready:
                kind, payload = self._recv_result()
                if kind == "ready":
                    self.num_kv_blocks = payload
                    return
                if kind == "error":
                    raise WorkerError(f"stepahead worker process failed to start: {payload}")
            self._proc.join(timeout=_SHUTDOWN_GRACE_S)
            raise WorkerError(
                f"stepahead worker process exited during startup ({exit_text(self._proc.exitcode)}). "
                "The worker is started with multiprocessing 'spawn'; if it failed while importing your "
                "script, guard the script's entry point with `if __name__ == '__main__':`."
            )

    def _read_results(self) -> None:
        while True:
            ready = wait([self._results, self._proc.sentinel])
            if self._results in ready:
                kind, payload = self._recv_result()
                if kind == "ok":  # the outputs of the oldest len(payload) calls
                    self._pending.resolve_oldest(payload)
                    continue
                if kind == "error":
                    self._fail(WorkerError(f"stepahead worker process failed: {payload}"))
                    return
            # The pipe closed or the process is gone; results it sent before dying were read above.
            if self._pending.closed:
                return
            self._proc.join(timeout=_SHUTDOWN_GRACE_S)
            self._fail(WorkerError(self._death_message()))
            return

    def _fail(self, error: WorkerError) -> None:
        self._pending.fail(error)
        self._notify_failure(self._pending.error or error)

    def _death_message(self) -> str:
        return f"stepahead worker process (pid {self._proc.pid}) died unexpectedly ({exit_text(self._proc.exitcode)})"

    def _stop_process(self) -> None:
        """Join the worker; terminate, then kill, one that does not exit on its own. No orphans."""
        stop_process(self._proc, _SHUTDOWN_GRACE_S, _SHUTDOWN_GRACE_S)
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join()  # it returns once it sees the process gone; only then close its pipe
        for conn in (self._calls, self._results):
            with contextlib.suppress(OSError):
                conn.close()
