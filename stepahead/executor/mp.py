"""MultiprocExecutor: the ModelRunner in spawned worker processes, one per tensor/pipeline-parallel rank
(one in all without parallelism).

On CPU only a separate process truly overlaps the engine's Python bookkeeping with the forward pass:
a worker process hides the bookkeeping almost fully, while a worker thread fights the engine for the
GIL (see uni.py).

Calls go down one pipe per rank in order; every rank receives the same message (docs/design.md,
"Tensor and pipeline parallelism": why every rank gets the message rather than a broadcast inside
each tensor group). Only the sampler rank (tensor rank 0 of the last stage) sends outputs back; a
reader thread takes them off its pipe and resolves the oldest pending futures with them. The reader
also watches every rank's pipe and process sentinel: a rank that fails or dies fails every pending
call, stops the other ranks (which would otherwise block in a collective) and calls the
notify_on_failure callback, so an engine with no call pending (idle) learns of it too.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from stepahead.config import EngineConfig
from stepahead.distributed.state import free_tcp_port
from stepahead.executor.abstract import WorkerError
from stepahead.executor.common import RankSpec, default_worker_threads
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
_KILL_GRACE_S = 2.0  # a surviving rank of a failed world gets this long after SIGTERM


@dataclass(frozen=True)
class _Watched:
    """What the executor waits on for some ranks: their result pipes and process sentinels, each
    mapped to its rank, and both as the one list multiprocessing's wait takes."""

    conns: dict[Connection, int]
    sentinels: dict[int, int]
    objects: list[Any]


class MultiprocExecutor(SubmittingExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config
        p = config.parallel_config
        self.world_size = p.world_size
        self.sampler_rank = p.sampler_rank
        lone = self.world_size == 1
        # A lone worker gets all cores: its OpenMP threads wait passively (spawn.WORKER_OMP_ENV).
        # Ranks share the cores: each leaves one to the engine, and keeps OpenMP's default waiting.
        self.num_threads = config.num_threads or default_worker_threads(config.device,
                                                                        lone and worker_waits_passively())
        spawn = multiprocessing.get_context("spawn")
        port = 0 if lone else free_tcp_port()  # a lone worker sets up no process group
        self._procs, self._calls, self._results = [], [], []
        worker_ends = []
        for rank in range(self.world_size):
            worker_calls, calls = spawn.Pipe(duplex=False)
            results, worker_results = spawn.Pipe(duplex=False)
            spec = None if lone else RankSpec(rank, "127.0.0.1", port)
            name = "stepahead-worker" if lone else f"stepahead-worker-rank{rank}"
            self._procs.append(spawn.Process(target=worker_main, name=name, daemon=True,
                                             args=(config, self.num_threads, worker_calls, worker_results, spec)))
            self._calls.append(calls)
            self._results.append(results)
            worker_ends += [worker_calls, worker_results]
        with main_module_hidden(), worker_environment() if lone else contextlib.nullcontext():
            for proc in self._procs:
                proc.start()
        for conn in worker_ends:  # only the workers hold these ends now, so their exit closes them
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
        # Ranks get the bytes of one pickling. A lone worker gets Connection.send's pickling, whose
        # reducers may pass a tensor by shared memory: a handle only one receiver can take.
        message = None if self.world_size == 1 else pickle.dumps((method, arg), protocol=pickle.HIGHEST_PROTOCOL)
        # _send_lock keeps calls in the order of their futures. The send itself holds no lock of
        # PendingCalls: a call larger than the pipe buffer blocks until the worker reads it, and the
        # reader thread must meanwhile be free to resolve results from the other pipe.
        with self._send_lock:
            fut = self._pending.add()
            if fut.done():
                return fut
            for rank, conn in enumerate(self._calls):
                try:
                    if message is None:
                        conn.send((method, arg))
                    else:
                        conn.send_bytes(message)
                except (OSError, ValueError) as e:  # broken pipe: this worker is gone
                    failed = rank
                    err = WorkerError(f"{self._worker_name(rank)} is gone (sending {method} failed: {e!r})")
                    break
            else:
                return fut
        self._fail(err, failed)
        return fut

    def _recv(self, rank: int) -> tuple[str, Any]:
        """One (kind, payload) message from a rank; ("died", None) when its pipe is gone."""
        try:
            return self._results[rank].recv()
        except (EOFError, OSError):
            return "died", None

    def _watch(self, ranks: Iterable[int]) -> _Watched:
        conns = {self._results[r]: r for r in ranks}
        sentinels = {self._procs[r].sentinel: r for r in ranks}
        return _Watched(conns, sentinels, [*conns, *sentinels])

    def _next_messages(self, watched: _Watched) -> list[tuple[int, str, Any]]:
        """Wait for news from the watched ranks: one message from each rank whose pipe has one, else
        (rank, "died", None) for each whose process ended. Pipes come first, so what a rank sent
        before dying (its error, its last outputs) is read before its death is noticed."""
        ready: list[Any] = wait(watched.objects)  # connections and sentinels, mixed
        mail = [(watched.conns[c], *self._recv(watched.conns[c])) for c in ready if c in watched.conns]
        return mail or [(watched.sentinels[s], "died", None) for s in ready]

    def _wait_ready(self) -> None:
        waiting = set(range(self.world_size))
        blocks: dict[int, int] = {}
        while waiting:
            for rank, kind, payload in self._next_messages(self._watch(waiting)):
                if kind == "ready":
                    blocks[rank] = payload
                    waiting.discard(rank)
                    continue
                if kind == "error":
                    raise WorkerError(f"{self._worker_name(rank)} failed to start: {payload}")
                self._procs[rank].join(timeout=_SHUTDOWN_GRACE_S)
                raise WorkerError(
                    f"{self._worker_name(rank)} exited during startup ({exit_text(self._procs[rank].exitcode)}). "
                    "Workers are started with multiprocessing 'spawn'; if one failed while importing your "
                    "script, guard the script's entry point with `if __name__ == '__main__':`."
                )
        self.num_kv_blocks = blocks[self.sampler_rank]

    def _read_results(self) -> None:
        watched = self._watch(range(self.world_size))  # built once: this loop runs every step
        rank_events: list = []
        while True:
            for rank, kind, payload in self._next_messages(watched):
                if kind == "trace":  # another stage's events ride on the sampler's next output
                    rank_events.extend(payload)
                    continue
                if kind == "ok" and rank == self.sampler_rank:  # the outputs of the oldest calls
                    if rank_events:
                        carrier = next((out for out in reversed(payload) if out is not None), None)
                        if carrier is not None:
                            carrier.trace_events = [*carrier.trace_events, *rank_events]
                            rank_events = []
                    self._pending.resolve_oldest(payload)
                    continue
                if kind == "error":
                    self._fail(WorkerError(f"{self._worker_name(rank)} failed: {payload}"), rank)
                    return
                if self._pending.closed:  # a pipe closed or a process ended after shutdown()
                    return
                self._procs[rank].join(timeout=_KILL_GRACE_S)
                self._fail(WorkerError(self._death_message(rank)), rank)
                return

    def _fail(self, error: WorkerError, failed_rank: int) -> None:
        """Fail every pending call, stop the other ranks (they would wait in a collective), notify.

        The failed rank itself is left alone: it exits after reporting its error, or is gone already.
        Joining it here too would race a caller's own join (two threads reaping one process: the
        loser of multiprocessing's waitpid may see it as still running)."""
        self._pending.fail(error)
        others = [proc for rank, proc in enumerate(self._procs) if rank != failed_rank]
        for proc in others:
            if proc.is_alive():
                proc.terminate()
        for proc in others:
            stop_process(proc, _KILL_GRACE_S, _KILL_GRACE_S)
        self._notify_failure(self._pending.error or error)

    def _worker_name(self, rank: int) -> str:
        return "stepahead worker process" if self.world_size == 1 else f"stepahead worker rank {rank}"

    def _death_message(self, rank: int) -> str:
        others = "" if self.world_size == 1 else "; the other ranks were stopped"
        return (f"{self._worker_name(rank)} (pid {self._procs[rank].pid}) died unexpectedly "
                f"({exit_text(self._procs[rank].exitcode)}){others}")

    def _stop_processes(self) -> None:
        """Join the workers; terminate, then kill, one that does not exit on its own. No orphans."""
        for proc in self._procs:
            stop_process(proc, _SHUTDOWN_GRACE_S, _SHUTDOWN_GRACE_S)
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join()  # it returns once it sees the processes gone; only then close its pipes
        for conn in (*self._calls, *self._results):
            with contextlib.suppress(OSError):
                conn.close()
