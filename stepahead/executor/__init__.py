"""How workers are run: "uni" (a thread of the engine process) or "mp" (a spawned worker process)."""

from __future__ import annotations

from stepahead.config import EngineConfig
from stepahead.executor.abstract import Executor


def make_executor(config: EngineConfig) -> Executor:
    if config.executor == "uni":
        from stepahead.executor.uni import UniProcExecutor

        return UniProcExecutor(config)
    if config.executor == "mp":
        from stepahead.executor.mp import MultiprocExecutor

        return MultiprocExecutor(config)
    raise ValueError(f"executor must be 'mp' or 'uni', got {config.executor!r}")


__all__ = ["Executor", "make_executor"]
