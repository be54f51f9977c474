"""How workers are run: "uni" (a thread of the engine process), "mp" (a spawned worker process, one per
rank with tensor/pipeline parallelism) or "ray" (worker ranks as Ray actors on a cluster's nodes)."""

from __future__ import annotations

from stepahead.config import EngineConfig
from stepahead.executor.abstract import Executor


def make_executor(config: EngineConfig) -> Executor:
    if config.executor == "ray":
        from stepahead.executor.ray_executor import RayExecutor  # ray is imported only when chosen

        return RayExecutor(config)
    if config.parallel_config.world_size > 1 and config.executor != "mp":
        raise ValueError(f"executor {config.executor!r} runs one worker; tensor/pipeline parallelism needs "
                         "'mp' or 'ray'")
    if config.executor == "uni":
        from stepahead.executor.uni import UniProcExecutor

        return UniProcExecutor(config)
    if config.executor == "mp":
        from stepahead.executor.mp import MultiprocExecutor

        return MultiprocExecutor(config)
    raise ValueError(f"executor must be 'mp', 'uni' or 'ray', got {config.executor!r}")


__all__ = ["Executor", "make_executor"]
