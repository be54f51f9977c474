"""Chrome / Perfetto trace files from the engine's trace events.

The engine (EngineArgs.trace=True) records spans as dicts
``{"name", "lane": "engine" | "worker", "start", "end" (time.monotonic seconds), "args": {...}}``.
Here each benchmarked run becomes one trace process (pid) with two threads (tid), "engine" and
"worker", so chrome://tracing or ui.perfetto.dev shows the runs stacked and the worker's idle gaps
between forward passes are visible at a glance.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

LANES = ("engine", "worker")


@dataclass(frozen=True)
class Span:
    name: str
    lane: str
    start: float  # seconds, time.monotonic
    end: float
    args: dict

    @property
    def duration(self) -> float:
        return self.end - self.start


def to_spans(events: Iterable[dict]) -> list[Span]:
    """Validate raw event dicts and sort them by start time."""
    spans = []
    for i, ev in enumerate(events):
        lane = ev.get("lane")
        if lane not in LANES:
            raise ValueError(f"trace event {i} lane must be one of {LANES}, got {lane!r}")
        start, end = float(ev["start"]), float(ev["end"])
        if end < start:
            raise ValueError(f"trace event {i} ({ev.get('name')!r}) ends before it starts: {start} > {end}")
        spans.append(Span(str(ev["name"]), lane, start, end, dict(ev.get("args") or {})))
    spans.sort(key=lambda s: (s.start, s.end))
    return spans


def chrome_trace(runs: Sequence[tuple[str, Sequence[Span]]]) -> dict:
    """One Chrome trace object for several runs; each run's clock starts at its own first event.

    Aligning every run at zero puts sync and async side by side in the viewer even though they ran
    one after the other.
    """
    out: list[dict] = []
    for pid, (label, spans) in enumerate(runs, start=1):
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid, lane in enumerate(LANES, start=1):
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        if not spans:
            continue
        t0 = min(s.start for s in spans)
        for s in spans:
            out.append({
                "name": s.name,
                "cat": s.lane,
                "ph": "X",
                "ts": round((s.start - t0) * 1e6, 3),
                "dur": round(s.duration * 1e6, 3),
                "pid": pid,
                "tid": LANES.index(s.lane) + 1,
                "args": s.args,
            })
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_trace(path: str | Path, runs: Sequence[tuple[str, Sequence[Span]]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(runs)))
    return path


def busy_seconds(spans: Sequence[Span], lane: str, t0: float, t1: float) -> float:
    """Time in [t0, t1] covered by at least one span of the lane (overlaps counted once)."""
    total, cur_start, cur_end = 0.0, None, None
    for s in sorted((s for s in spans if s.lane == lane), key=lambda s: s.start):
        a, b = max(s.start, t0), min(s.end, t1)
        if b <= a:
            continue
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def forward_spans(spans: Sequence[Span]) -> list[Span]:
    """The worker's forward passes, in order: one per executed step."""
    return [s for s in spans if s.lane == "worker" and s.name == "forward"]


def worker_gaps(spans: Sequence[Span]) -> dict[str, dict[str, float]]:
    """Idle time of the worker lane between consecutive spans, by transition ("forward->sample", ...).

    Where the accelerator waits is where the step-ahead scheduler should help: "sample->prepare_inputs"
    is the turn-around between steps (result back, bookkeeping, next step in), "forward->sample" the
    round trip between the two halves of one step.
    """
    work = sorted((s for s in spans if s.lane == "worker"), key=lambda s: s.start)
    gaps: dict[str, list[float]] = {}
    for a, b in zip(work, work[1:], strict=False):
        gaps.setdefault(f"{a.name}->{b.name}", []).append(max(0.0, b.start - a.end))
    out = {}
    for key, values in gaps.items():
        values.sort()
        out[key] = {"count": len(values), "median_ms": values[len(values) // 2] * 1e3,
                    "mean_ms": sum(values) / len(values) * 1e3, "total_s": sum(values)}
    return out
