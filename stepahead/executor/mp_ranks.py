"""MultiprocRanksExecutor: the mp executor of a tensor/pipeline-parallel model, one process per rank.

Every rank receives the same call message on its own pipe: the step's SchedulerOutput is pickled once
and its bytes written to each pipe (docs/design.md, "Tensor and pipeline parallelism": why every rank
gets the message rather than a broadcast inside each tensor group). Only the sampler rank (tensor rank
0 of the last stage) sends outputs back; the reader thread resolves the oldest futures with them. The
reader also watches every rank's pipe and process sentinel: a rank that fails or dies fails every
pending call, stops the other ranks (which would otherwise block in a collective) and calls the
notify_on_failure callback, as the single-process MultiprocExecutor does.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import threading
from concurrent.futures import Future
from multiprocessing.connection import wait
from typing import Any

from stepahead.config import EngineConfig
from stepahead.distributed.state import free_tcp_port
from stepahead.executor.abstract import WorkerError
from stepahead.executor.common import RankSpec, default_worker_threads
from stepahead.executor.spawn import exit_text, main_module_hidden, stop_process
from stepahead.executor.submitting import SubmittingExecutor
from stepahead.executor.worker_proc import worker_main

_SHUTDOWN_GRACE_S = 5.0
_KILL_GRACE_S = 2.0  # a surviving rank of a failed world gets this long after SIGTERM


class MultiprocRanksExecutor(SubmittingExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config
        p = config.parallel_config
        self.world_size = p.world_size
        self.sampler_rank = p.sampler_rank
        self.num_threads = config.num_threads or default_worker_threads(config.device)
        spawn = multiprocessing.get_context("spawn")
        port = free_tcp_port()
        self._procs, self._calls, self._results = [], [], []
        worker_ends = []
        for rank in range(self.world_size):
            worker_calls, calls = spawn.Pipe(duplex=False)
            results, worker_results = spawn.Pipe(duplex=False)
            proc = spawn.Process(target=worker_main, name=f"stepahead-worker-rank{rank}", daemon=True,
                                 args=(config, self.num_threads, worker_calls, worker_results,
                                       RankSpec(rank, "127.0.0.1", port)))
            self._procs.append(proc)
            self._calls.append(calls)
            self._results.append(results)
            worker_ends += [worker_calls, worker_results]
        with main_module_hidden():
            for proc in self._procs:
                proc.start()
        for conn in worker_ends:  # only the workers hold these ends now
            conn.close()
        self._send_lock = threading.Lock()
        try:
            self._wait_ready()
        except BaseException:
            self._stop_processes()
            raise
        self._reader = threading.Thread(target=self._read_results, name="stepahead-executor-reader", daemon=True)
        self._reader.start()

    # -- Executor API ---------------------------------------------------------------------------

    def check_health(self) -> None:
        super().check_health()
        if not self._pending.closed:
            for rank, proc in enumerate(self._procs):
                if not proc.is_alive():
                    raise WorkerError(self._death_message(rank))

    @property
    def worker_pids(self) -> list[int | None]:
        return [proc.pid for proc in self._procs]

    @property
    def worker_pid(self) -> int | None:
        """The sampler rank's process (the one whose outputs the engine reads)."""
        return self._procs[self.sampler_rank].pid

    def shutdown(self) -> None:
        if not self._pending.close():
            return
        with self._send_lock:
            for conn in self._calls:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(("shutdown", None))
        self._stop_processes()
        self._pending.fail_after_close()

    # -- internals ------------------------------------------------------------------------------

    def _submit(self, method: str, arg: Any) -> Future:
        message = pickle.dumps((method, arg), protocol=pickle.HIGHEST_PROTOCOL)  # once for every rank
        with self._send_lock:
            fut = self._pending.add()
            if fut.done():
                return fut
            try:
                for conn in self._calls:
                    conn.send_bytes(message)
                return fut
            except (OSError, ValueError) as e:  # broken pipe: a rank is gone
                err = WorkerError(f"a stepahead worker rank is gone (sending {method} failed: {e!r})")
        self._fail(err)
        return fut

    def _recv(self, rank: int) -> tuple[str, Any]:
        try:
            return self._results[rank].recv()
        except (EOFError, OSError):
            return "died", None

    def _wait_ready(self) -> None:
        waiting = set(range(self.world_size))
        blocks: dict[int, int] = {}
        while waiting:
            conns = {self._results[r]: r for r in waiting}
            sentinels = {self._procs[r].sentinel: r for r in waiting}
            for ready in wait([*conns, *sentinels]):
                rank = conns.get(ready)
                if rank is not None:
                    kind, payload = self._recv(rank)
                    if kind == "ready":
                        blocks[rank] = payload
                        waiting.discard(rank)
                        continue
                    if kind == "error":
                        raise WorkerError(f"stepahead worker rank {rank} failed to start: {payload}")
                rank = conns.get(ready, sentinels.get(ready))
                self._procs[rank].join(timeout=_SHUTDOWN_GRACE_S)
                raise WorkerError(f"stepahead worker rank {rank} exited during startup "
                                  f"({exit_text(self._procs[rank].exitcode)}). Workers are started with "
                                  "multiprocessing 'spawn'; guard your script's entry point with "
                                  "`if __name__ == '__main__':`.")
        self.num_kv_blocks = blocks[self.sampler_rank]

    def _read_results(self) -> None:
        conns = {conn: rank for rank, conn in enumerate(self._results)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        rank_events: list = []
        while True:
            for ready in wait([*conns, *sentinels]):
                rank = conns.get(ready)
                if rank is not None:
                    kind, payload = self._recv(rank)
                    if kind == "trace":  # another stage's events ride on the sampler's next output
                        rank_events.extend(payload)
                        continue
                    if kind == "ok" and rank == self.sampler_rank:
                        if rank_events:
                            carrier = next((out for out in reversed(payload) if out is not None), None)
                            if carrier is not None:
                                carrier.trace_events = [*carrier.trace_events, *rank_events]
                                rank_events = []
                        self._pending.resolve_oldest(payload)
                        continue
                    if kind == "error":
                        self._fail(WorkerError(f"stepahead worker rank {rank} failed: {payload}"))
                        return
                # A pipe closed or a process is gone; what it sent before dying was read above.
                if self._pending.closed:
                    return
                rank = conns.get(ready, sentinels.get(ready))
                self._procs[rank].join(timeout=_KILL_GRACE_S)
                self._fail(WorkerError(self._death_message(rank)))
                return

    def _fail(self, error: WorkerError) -> None:
        """Fail every pending call, stop every rank (the survivors would wait in a collective), notify."""
        self._pending.fail(error)
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            stop_process(proc, _KILL_GRACE_S, _KILL_GRACE_S)
        self._notify_failure(self._pending.error or error)

    def _death_message(self, rank: int) -> str:
        proc = self._procs[rank]
        return (f"stepahead worker rank {rank} (pid {proc.pid}) died unexpectedly "
                f"({exit_text(proc.exitcode)}); the other ranks were stopped")

    def _stop_processes(self) -> None:
        for proc in self._procs:
            stop_process(proc, _SHUTDOWN_GRACE_S, _SHUTDOWN_GRACE_S)
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join()
        for conn in (*self._calls, *self._results):
            with contextlib.suppress(OSError):
                conn.close()
