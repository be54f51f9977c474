"""SubmittingExecutor: what every executor shares that hands calls to a worker (thread, process, ranks
or Ray actors) and returns their futures.

Each call becomes a future in PendingCalls, resolved in submission order. The first failure fails every
pending and later call, and tells the one notify_on_failure subscriber, so an engine with no call
pending (idle) learns of a dead worker too.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from stepahead.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from stepahead.executor.abstract import Executor
from stepahead.executor.pending import PendingCalls


class SubmittingExecutor(Executor):
    def __init__(self) -> None:
        self._pending = PendingCalls()
        self._on_failure: Callable[[RuntimeError], None] | None = None
        self._failure_lock = threading.Lock()

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput | None]:
        return self._submit("execute_model", scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> Future[ModelRunnerOutput]:
        return self._submit("sample_tokens", grammar_output)

    @abstractmethod
    def _submit(self, method: str, arg: Any) -> Future:
        """Send (method, arg) to the worker(s) after every earlier call; the future of its result."""

    def check_health(self) -> None:
        if self._pending.error is not None:
            raise self._pending.error

    def notify_on_failure(self, callback: Callable[[RuntimeError], None]) -> None:
        """Call callback(error) once when the worker fails or dies (from the executor's thread, or now if it has).

        Not called for a worker stopped by shutdown(). Pending futures fail either way; this is for a
        caller that has none, such as an idle engine blocked on its own input queue.
        """
        with self._failure_lock:
            self._on_failure = callback
            error = self._pending.error
        if error is not None:
            self._notify_failure(error)

    def _notify_failure(self, error: RuntimeError) -> None:
        with self._failure_lock:  # taking the callback under the lock makes it one call, whoever gets here first
            callback, self._on_failure = self._on_failure, None
        if callback is not None:
            callback(error)
