"""Spawned helper processes (the mp worker, the server's engine process): start them without re-running
the caller's script, and stop them without leaving one behind."""

from __future__ import annotations

import contextlib
import os
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


# OpenMP settings for a worker process, read once when torch's OpenMP runtime starts in the child.
# PASSIVE: a thread that runs out of work sleeps instead of spinning. With every core computing and
# the engine process sharing them, a spinning thread steals the core the engine (or a sibling
# thread) needs, and a thread that lost its core holds up every parallel region after it
# (docs/BENCHMARKS.md section 14). Values the user set are kept.
WORKER_OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def worker_waits_passively() -> bool:
    """Whether a worker spawned now gets passive OpenMP waiting (the user may have set another policy)."""
    return os.environ.get("OMP_WAIT_POLICY", WORKER_OMP_ENV["OMP_WAIT_POLICY"]).upper() == "PASSIVE"


@contextlib.contextmanager
def worker_environment(env: dict[str, str] = WORKER_OMP_ENV) -> Iterator[None]:
    """Set env (keeping values already set) while a child process is spawned: the child copies the
    parent's environment at start, before it imports torch."""
    added = {key: value for key, value in env.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


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


def exit_text(code: int | None) -> str:
    """A worker process's exit code in words, for error messages."""
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit code {code}"
