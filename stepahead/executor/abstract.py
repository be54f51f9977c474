"""How the engine core talks to workers: two calls per step, each returning a real future."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from stepahead.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from stepahead.errors import StepaheadError


class WorkerError(StepaheadError, RuntimeError):
    """The worker could not start, raised in a call, or died; every pending and later call fails with it."""


class Executor(ABC):
    """execute_model runs the forward pass; sample_tokens samples from its logits.

    They are separate so a step's sampling can wait for a grammar while its forward pass already
    runs (docs/design.md, "Deferred sampling for grammars"). Calls are processed by the worker
    strictly in submission order; up to max_concurrent_batches steps may be in flight.
    execute_model's future resolves to None when sampling follows, or to an output directly for
    an empty step. A worker failure resolves every pending future with a WorkerError.
    """

    # The KV pool size (blocks) the worker allocated, once it is up; None when it used the config's.
    num_kv_blocks: int | None = None

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput | None]: ...

    @abstractmethod
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> Future[ModelRunnerOutput]: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    def check_health(self) -> None:  # noqa: B027 - optional hook
        """Raise if a worker has died."""
