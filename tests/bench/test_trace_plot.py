"""Trace writer and timeline plot on hand-built event lists (the engine's end-to-end trace is in test_throughput)."""

from __future__ import annotations

import json
import pickle

import msgspec
import pytest

from stepahead.bench.plot import plot_timelines, steady_window
from stepahead.bench.trace import busy_seconds, by_start, worker_gaps
from stepahead.engine.chrome_trace import write_trace
from stepahead.tracing import TraceEvent


def _sync_events(num_steps: int, start: float = 100.0) -> list[TraceEvent]:
    """A synchronous loop: schedule, then prepare/forward/sample, then update, strictly one after another."""
    events, now = [], start
    for step in range(num_steps):
        events.append(TraceEvent("schedule", "engine", now, now + 0.002, {"step": step}))
        now += 0.002
        for name, duration in (("prepare_inputs", 0.001), ("forward", 0.010), ("sample", 0.001)):
            events.append(TraceEvent(name, "worker", now, now + duration, {"num_reqs": 4}))
            now += duration
        events.append(TraceEvent("update_from_output", "engine", now, now + 0.003))
        now += 0.003
    return events


def test_chrome_trace_has_both_lanes_in_microseconds(tmp_path):
    spans = _sync_events(3)
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
        TraceEvent("x", "gpu", 0.0, 1.0)
    with pytest.raises(ValueError, match="ends before"):
        TraceEvent("x", "worker", 2.0, 1.0)


def test_events_survive_the_worker_pipe_and_a_typed_msgspec_decode():
    """The worker pipe pickles events; msgspec, the engine socket's codec, decodes them back by type."""
    events = _sync_events(1)
    assert pickle.loads(pickle.dumps(events)) == events
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(events), type=list[TraceEvent])
    assert decoded == events and all(isinstance(event, TraceEvent) for event in decoded)
    with pytest.raises(ValueError, match="ends before"):  # validation runs on decode too
        msgspec.msgpack.decode(msgspec.msgpack.encode([{"name": "x", "lane": "worker", "start": 2.0, "end": 1.0,
                                                        "args": {}}]), type=list[TraceEvent])


def test_busy_seconds_merges_overlaps():
    spans = [
        TraceEvent("a", "worker", 0.0, 2.0),
        TraceEvent("b", "worker", 1.0, 3.0),
        TraceEvent("c", "worker", 5.0, 6.0),
        TraceEvent("d", "engine", 0.0, 10.0),
    ]
    assert busy_seconds(spans, "worker", 0.0, 10.0) == pytest.approx(4.0)
    assert busy_seconds(spans, "worker", 2.5, 5.5) == pytest.approx(1.0)


def test_plot_writes_png_with_window_in_the_middle(tmp_path):
    spans = list(reversed(_sync_events(20)))  # the window comes out the same in any order
    win = steady_window(spans, 4)
    spans = by_start(spans)
    fwd = [s for s in spans if s.name == "forward"]
    assert fwd[8].start > win.start > fwd[7].start and win.end == fwd[11].end
    out = plot_timelines([("sync", spans), ("async", spans)], tmp_path / "img" / "t.png", num_steps=4, title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_needs_forward_spans(tmp_path):
    spans = [TraceEvent("schedule", "engine", 0.0, 1.0)]
    with pytest.raises(ValueError, match="forward"):
        plot_timelines([("x", spans)], tmp_path / "x.png")


def test_worker_gaps_by_transition():
    gaps = worker_gaps(_sync_events(4))
    # _sync_events: prepare -> forward -> sample back to back, then 5 ms of engine work before the next step.
    assert gaps["prepare_inputs->forward"]["median_ms"] == pytest.approx(0.0)
    assert gaps["sample->prepare_inputs"]["count"] == 3
    assert gaps["sample->prepare_inputs"]["median_ms"] == pytest.approx(5.0)
    assert gaps["sample->prepare_inputs"]["total_s"] == pytest.approx(0.015)
