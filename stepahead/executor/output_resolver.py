"""OutputResolver: hands a worker's results on in call order from a thread of its own, waiting there,
off the worker's call path, for async outputs whose sampled ids are still being copied from the GPU."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from stepahead.worker.async_output import AsyncModelRunnerOutput

_STOP = object()


class OutputResolver:
    """`put` a call's result (an output, an async output or None); `deliver` receives each in order,
    resolved. If resolving fails, `fail` receives the error and nothing is delivered after it."""

    def __init__(self, deliver: Callable[[Any], None], fail: Callable[[BaseException], None]) -> None:
        self._deliver = deliver
        self._fail = fail
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="stepahead-output", daemon=True)
        self._thread.start()

    def put(self, result: Any) -> None:
        self._queue.put(result)

    def close(self) -> None:
        """Deliver what was put so far, then stop the thread."""
        self._queue.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            try:
                if isinstance(item, AsyncModelRunnerOutput):
                    item = item.get_output()
            except BaseException as e:  # e.g. a CUDA error surfacing at the event
                self._fail(e)
                return
            self._deliver(item)
