"""Spawned helper processes (the mp worker, the server's engine process): start them without re-running
the caller's script, and stop them without leaving one behind."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from multiprocessing.process import BaseProcess


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Keep spawn from re-running the caller's main script in a child process.

    spawn re-imports `__main__` in the child, so a script calling LLM() at top level without an
    `if __name__ == "__main__":` guard would start a second engine there. The worker and the engine
    process need nothing from the caller's script, so the main module's file and spec are hidden
    while the process starts.
    """
    main = sys.modules.get("__main__")
    saved = {key: main.__dict__[key] for key in ("__file__", "__spec__")
             if main is not None and key in main.__dict__}
    try:
        for key in saved:
            if key == "__file__":
                del main.__dict__[key]
            else:
                main.__dict__[key] = None
        yield
    finally:
        for key, value in saved.items():
            main.__dict__[key] = value


def stop_process(proc: BaseProcess, exit_wait_s: float, grace_s: float) -> None:
    """Wait up to exit_wait_s for the process to exit on its own, then SIGTERM it, then SIGKILL it.

    SIGTERM gets grace_s to work (the engine process shuts its executor down on it). A process that
    was never started is left alone.
    """
    if proc.pid is None:
        return
    proc.join(timeout=exit_wait_s)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=grace_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
