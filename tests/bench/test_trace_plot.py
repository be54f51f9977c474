"""Trace writer and timeline plot on hand-built event lists (the engine's end-to-end trace is in test_throughput)."""

from __future__ import annotations

import json

import pytest

from stepahead.bench.plot import plot_timelines, steady_window
from stepahead.bench.trace import busy_seconds, to_spans, write_trace


def _sync_events(n_steps: int, t0: float = 100.0) -> list[dict]:
    """A synchronous loop: schedule, then prepare/forward/sample, then update, strictly one after another."""
    ev, t = [], t0
    for i in range(n_steps):
        ev.append({"name": "schedule", "lane": "engine", "start": t, "end": t + 0.002, "args": {"step": i}})
        t += 0.002
        for name, d in (("prepare_inputs", 0.001), ("forward", 0.010), ("sample", 0.001)):
            ev.append({"name": name, "lane": "worker", "start": t, "end": t + d, "args": {"num_reqs": 4}})
            t += d
        ev.append({"name": "update_from_output", "lane": "engine", "start": t, "end": t + 0.003, "args": {}})
        t += 0.003
    return ev


def test_chrome_trace_has_both_lanes_in_microseconds(tmp_path):
    spans = to_spans(_sync_events(3))
    path = write_trace(tmp_path / "t.json", [("sync", spans), ("async", spans)])
    data = json.loads(path.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in xs} == {1, 2} and {e["pid"] for e in xs} == {1, 2}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert names[(1, 1)] == "engine" and names[(1, 2)] == "worker"
    first_fwd = next(e for e in xs if e["name"] == "forward")
    assert first_fwd["ts"] == pytest.approx(3000.0) and first_fwd["dur"] == pytest.approx(10000.0)
    assert min(e["ts"] for e in xs if e["pid"] == 1) == 0.0
    assert first_fwd["args"] == {"num_reqs": 4}


def test_bad_events_are_rejected():
    with pytest.raises(ValueError, match="lane"):
        to_spans([{"name": "x", "lane": "gpu", "start": 0, "end": 1}])
    with pytest.raises(ValueError, match="ends before"):
        to_spans([{"name": "x", "lane": "worker", "start": 2, "end": 1}])


def test_busy_seconds_merges_overlaps():
    spans = to_spans([
        {"name": "a", "lane": "worker", "start": 0.0, "end": 2.0},
        {"name": "b", "lane": "worker", "start": 1.0, "end": 3.0},
        {"name": "c", "lane": "worker", "start": 5.0, "end": 6.0},
        {"name": "d", "lane": "engine", "start": 0.0, "end": 10.0},
    ])
    assert busy_seconds(spans, "worker", 0.0, 10.0) == pytest.approx(4.0)
    assert busy_seconds(spans, "worker", 2.5, 5.5) == pytest.approx(1.0)


def test_plot_writes_png_with_window_in_the_middle(tmp_path):
    spans = to_spans(_sync_events(20))
    win = steady_window(spans, 4)
    fwd = [s for s in spans if s.name == "forward"]
    assert fwd[8].start > win.start > fwd[7].start and win.end == fwd[11].end
    out = plot_timelines([("sync", spans), ("async", spans)], tmp_path / "img" / "t.png", num_steps=4, title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_needs_forward_spans(tmp_path):
    spans = to_spans([{"name": "schedule", "lane": "engine", "start": 0.0, "end": 1.0}])
    with pytest.raises(ValueError, match="forward"):
        plot_timelines([("x", spans)], tmp_path / "x.png")


def test_worker_gaps_by_transition():
    from stepahead.bench.trace import worker_gaps

    gaps = worker_gaps(to_spans(_sync_events(4)))
    # _sync_events: prepare -> forward -> sample back to back, then 5 ms of engine work before the next step.
    assert gaps["prepare_inputs->forward"]["median_ms"] == pytest.approx(0.0)
    assert gaps["sample->prepare_inputs"]["count"] == 3
    assert gaps["sample->prepare_inputs"]["median_ms"] == pytest.approx(5.0)
    assert gaps["sample->prepare_inputs"]["total_s"] == pytest.approx(0.015)
