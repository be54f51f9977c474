"""Chrome / Perfetto trace files from the engine's TraceEvents (written by `stepahead serve --trace`
and the benchmarks' --trace).

Each run becomes one trace process (pid) with two threads (tid), "engine" and "worker", so
chrome://tracing or ui.perfetto.dev shows the runs stacked and the worker's idle gaps between
forward passes are visible at a glance.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from stepahead.tracing import LANES, TraceEvent

# (label, events) of one run.
TraceRun = tuple[str, Sequence[TraceEvent]]


def chrome_trace(runs: Sequence[TraceRun]) -> dict:
    """One Chrome trace object for several runs; each run's clock starts at its own first event.

    Aligning every run at zero puts sync and async side by side in the viewer even though they ran
    one after the other.
    """
    trace_events: list[dict] = []
    for pid, (label, events) in enumerate(runs, start=1):
        trace_events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
        trace_events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                             "args": {"sort_index": pid}})
        for tid, lane in enumerate(LANES, start=1):
            trace_events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
            trace_events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                                 "args": {"sort_index": tid}})
        if not events:
            continue
        run_start = min(event.start for event in events)
        for event in events:
            trace_events.append({
                "name": event.name,
                "cat": event.lane,
                "ph": "X",
                "ts": round((event.start - run_start) * 1e6, 3),
                "dur": round(event.duration * 1e6, 3),
                "pid": pid,
                "tid": LANES.index(event.lane) + 1,
                "args": event.args,
            })
    return {"traceEvents": trace_events, "displayTimeUnit": "ms"}


def write_trace(path: str | Path, runs: Sequence[TraceRun]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(runs)))
    return path
