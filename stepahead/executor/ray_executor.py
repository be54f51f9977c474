"""RayExecutor: the worker ranks as Ray actors, placed on a Ray cluster's nodes (--distributed-executor-backend ray).

A placement group holds one bundle per rank (a CPU, or a GPU on CUDA); rank r's actor goes in bundle r.
The actors run the same runner as the mp workers and join the same torch.distributed groups: rank 0's
actor picks the TCP store's address (its node's IP and a free port) and every actor joins it. Each call
goes to every actor (the argument is put in Ray's object store once); actors run their calls in order,
and a resolver thread resolves the oldest future with the sampler rank's result once every rank has
finished that call. A failed call or a dead actor (RayActorError) fails every pending call and kills
the other actors. ray is imported here only: it is an optional extra (pip install 'stepahead[ray]').
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from typing import Any

from stepahead.config import EngineConfig
from stepahead.core.sched_output import ModelRunnerOutput
from stepahead.executor.abstract import WorkerError
from stepahead.executor.common import RankSpec, RunnerCalls, default_worker_threads
from stepahead.executor.submitting import SubmittingExecutor

_STOP = object()


class RankWorker:
    """The body of one rank's Ray actor."""

    def __init__(self, config: EngineConfig, num_threads: int) -> None:
        self.config = config
        self.num_threads = num_threads
        self.calls: RunnerCalls | None = None

    def store_address(self) -> tuple[str, int]:
        import ray

        from stepahead.distributed.state import free_tcp_port

        host = ray.util.get_node_ip_address()
        return host, free_tcp_port(host)

    def pid(self) -> int:
        return os.getpid()

    def start(self, rank: RankSpec) -> int | None:
        from stepahead.executor.common import load_runner

        self.calls = calls = load_runner(self.config, self.num_threads, rank)
        return calls.num_kv_blocks

    def call(self, method: str, arg: Any) -> ModelRunnerOutput | None:
        calls = self.calls
        if calls is None:
            raise WorkerError(f"{method} before the rank was started")
        output = calls(method, arg)
        return output if calls.reports_outputs else None


class RayExecutor(SubmittingExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as e:
            raise ValueError("distributed_executor_backend 'ray' needs ray: pip install 'stepahead[ray]'") from e
        self._ray = ray
        self.config = config
        p = config.parallel_config
        self.world_size = p.world_size
        self.sampler_rank = p.sampler_rank
        num_threads = config.num_threads or default_worker_threads(config.device)
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True)  # RAY_ADDRESS's cluster, or a local one
        resource = {"GPU": 1} if config.device == "cuda" else {"CPU": 1}
        self._pg = placement_group([dict(resource) for _ in range(self.world_size)], strategy="PACK")
        ray.get(self._pg.ready())
        actor_cls = ray.remote(RankWorker)
        self._actors: list[Any] = [  # ray actor handles: their methods are bound at run time
            actor_cls.options(num_cpus=resource.get("CPU", 0), num_gpus=resource.get("GPU", 0),
                              scheduling_strategy=PlacementGroupSchedulingStrategy(
                                  self._pg, placement_group_bundle_index=rank)).remote(config, num_threads)
            for rank in range(self.world_size)
        ]
        self._send_lock = threading.Lock()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        try:
            host, port = ray.get(self._actors[0].store_address.remote())
            starts = [a.start.remote(RankSpec(rank, host, port)) for rank, a in enumerate(self._actors)]
            blocks = ray.get(starts)
            self.worker_pids = ray.get([a.pid.remote() for a in self._actors])
        except Exception as e:
            self._kill_actors()
            raise WorkerError(f"stepahead Ray worker ranks failed to start: {e}") from e
        self.num_kv_blocks = blocks[self.sampler_rank]
        self._resolver = threading.Thread(target=self._resolve, name="stepahead-ray-resolver", daemon=True)
        self._resolver.start()

    # -- Executor API ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        if not self._pending.close():
            return
        self._calls.put(_STOP)
        if self._resolver is not threading.current_thread():
            self._resolver.join(timeout=30)
        self._kill_actors()
        self._pending.fail_after_close()

    # -- internals ------------------------------------------------------------------------------

    def _submit(self, method: str, arg: Any) -> Future:
        with self._send_lock:  # every actor gets the calls in the same order
            fut = self._pending.add()
            if not fut.done():
                ref = self._ray.put(arg)
                self._calls.put([a.call.remote(method, ref) for a in self._actors])
            return fut

    def _resolve(self) -> None:
        while True:
            refs = self._calls.get()
            if refs is _STOP:
                return
            try:
                outputs = self._ray.get(refs)
            except Exception as e:  # a rank raised or its actor died
                if self._pending.closed:
                    return
                error = WorkerError(f"a stepahead Ray worker rank failed or died: {e}")
                self._pending.fail(error)
                self._kill_actors()
                self._notify_failure(self._pending.error or error)
                return
            self._pending.resolve_oldest([outputs[self.sampler_rank]])

    def _kill_actors(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for actor in self._actors:
            try:
                self._ray.kill(actor)
            except Exception:  # already gone
                pass
        try:
            remove_placement_group(self._pg)
        except Exception:
            pass
