"""TraceEvent: one span of a timeline trace, recorded by the engine and the worker when tracing is on.

Events cross the worker pipe as plain data (pickled); stepahead.engine.chrome_trace writes them as
Chrome/Perfetto traces, and bench/ turns them into two-lane plots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LANES = ("engine", "worker")


@dataclass(frozen=True)
class TraceEvent:
    name: str
    lane: str  # "engine" | "worker"
    start: float  # seconds, time.monotonic
    end: float
    args: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.lane not in LANES:
            raise ValueError(f"trace event lane must be one of {LANES}, got {self.lane!r}")
        if self.end < self.start:
            raise ValueError(f"trace event {self.name!r} ends before it starts: {self.start} > {self.end}")

    @property
    def duration(self) -> float:
        return self.end - self.start
