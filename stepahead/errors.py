"""The exceptions stepahead raises on purpose, so callers can catch them by type."""

from __future__ import annotations


class StepaheadError(Exception):
    """Base of every error stepahead raises on purpose."""


class EngineDeadError(StepaheadError, RuntimeError):
    """The executor failed; the engine cannot continue.

    `outputs` (on the first raise only) holds one finish_reason "error" output per request that was
    unfinished when the engine died. It subclasses RuntimeError for callers that caught that before
    the type existed.
    """

    def __init__(self, message: str, outputs: list | None = None) -> None:
        super().__init__(message)
        self.outputs = outputs or []


class EngineShutdownError(StepaheadError, RuntimeError):
    """The engine was shut down while a request still ran (the server answers 503, not 500)."""
