"""What the benchmarks read from the engine's TraceEvents: busy time, forward passes, the worker's idle gaps.

Trace files themselves are written by stepahead.engine.chrome_trace.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from stepahead.tracing import TraceEvent


def by_start(events: Iterable[TraceEvent]) -> list[TraceEvent]:
    """Events in time order (the engine records a step's worker events after its own)."""
    return sorted(events, key=lambda event: (event.start, event.end))


def busy_seconds(events: Sequence[TraceEvent], lane: str, window_start: float, window_end: float) -> float:
    """Time in [window_start, window_end] covered by at least one event of the lane (overlaps counted once)."""
    total = 0.0
    merged_start: float | None = None
    merged_end: float | None = None
    for event in by_start(event for event in events if event.lane == lane):
        start, end = max(event.start, window_start), min(event.end, window_end)
        if end <= start:
            continue
        if merged_end is None or start > merged_end:
            if merged_start is not None and merged_end is not None:
                total += merged_end - merged_start
            merged_start, merged_end = start, end
        else:
            merged_end = max(merged_end, end)
    if merged_start is not None and merged_end is not None:
        total += merged_end - merged_start
    return total


def forward_events(events: Sequence[TraceEvent]) -> list[TraceEvent]:
    """The worker's forward passes, in order: one per executed step."""
    return [event for event in by_start(events) if event.lane == "worker" and event.name == "forward"]


def worker_gaps(events: Sequence[TraceEvent]) -> dict[str, dict[str, float]]:
    """Idle time of the worker lane between consecutive events, by transition ("forward->sample", ...).

    Where the accelerator waits is where the step-ahead scheduler should help: "sample->prepare_inputs"
    is the turn-around between steps (result back, bookkeeping, next step in), "forward->sample" the
    round trip between the two halves of one step.
    """
    work = by_start(event for event in events if event.lane == "worker")
    gaps: dict[str, list[float]] = {}
    for before, after in zip(work, work[1:], strict=False):
        gaps.setdefault(f"{before.name}->{after.name}", []).append(max(0.0, after.start - before.end))
    figures = {}
    for transition, values in gaps.items():
        values.sort()
        figures[transition] = {"count": len(values), "median_ms": values[len(values) // 2] * 1e3,
                               "mean_ms": sum(values) / len(values) * 1e3, "total_s": sum(values)}
    return figures
