"""The futures of calls a worker has not answered yet, shared by the mp and uni executors."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

SHUT_DOWN_MESSAGE = "stepahead executor was shut down"


class PendingCalls:
    """Oldest first: a worker answers calls in submission order.

    After the first failure (`fail`) or `close`, every pending call fails with that error and
    every later call fails at once, so no caller ever waits on a worker that is gone.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: deque[Future] = deque()
        self.error: RuntimeError | None = None
        self.closed = False

    def add(self) -> Future:
        future: Future = Future()
        with self._lock:
            if self.error is None and not self.closed:
                self._futures.append(future)
                return future
        future.set_exception(self.error or RuntimeError(SHUT_DOWN_MESSAGE))
        return future

    def resolve_oldest(self, outputs: list[Any]) -> None:
        with self._lock:
            oldest = [self._futures.popleft() for _ in range(min(len(outputs), len(self._futures)))]
        for future, output in zip(oldest, outputs, strict=False):
            future.set_result(output)

    def fail(self, err: RuntimeError) -> None:
        """Record err unless an earlier failure is recorded, and fail every pending call with it."""
        with self._lock:
            if self.error is None:
                self.error = err
        self._fail_all(self.error)

    def close(self) -> bool:
        """Refuse later calls; False if already closed. Pending calls fail in fail_after_close."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
        return True

    def fail_after_close(self) -> None:
        self._fail_all(RuntimeError(SHUT_DOWN_MESSAGE))

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            pending, self._futures = self._futures, deque()
        for future in pending:
            if not future.done():
                future.set_exception(err)
