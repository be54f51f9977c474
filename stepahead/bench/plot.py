"""Two-lane timeline plots (engine above worker) for a window of steady-state steps, one run per row.

With the synchronous scheduler the worker lane has a gap after every forward pass while the engine
schedules and processes outputs; with the step-ahead scheduler those spans move under the next
forward pass and the worker lane is solid. Every row shares one time axis, so a faster run ends
visibly earlier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from stepahead.bench.trace import busy_seconds, forward_events
from stepahead.tracing import TraceEvent

# Fixed colours for the events the engine and worker emit; anything else takes the next colour of the cycle.
KNOWN_COLORS = {
    "schedule": "#4c72b0",
    "update_from_output": "#dd8452",
    "process_outputs": "#c44e52",
    "output_processing": "#c44e52",
    "prepare_inputs": "#8172b3",
    "forward": "#55a868",
    "sample": "#937860",
}
MIN_VISIBLE = 0.002  # fraction of the time axis
EXTRA_COLORS = ["#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd", "#2f4b7c"]


@dataclass
class Window:
    """The slice of one run that is drawn: num_steps forward passes from the middle of the run."""

    start: float
    end: float
    num_steps: int

    @property
    def length(self) -> float:
        return self.end - self.start


def steady_window(events: Sequence[TraceEvent], num_steps: int) -> Window:
    """num_steps consecutive forward passes centred in the run (skips start-up and drain)."""
    forwards = forward_events(events)
    stages = {e.args.get("stage") for e in forwards}
    if len(stages) > 1:  # pipeline parallel: a step is the last stage's forward
        last = max(stages)  # type: ignore[type-var]  # pipeline runs stamp every forward with its stage
        forwards = [e for e in forwards if e.args.get("stage") == last]
    if not forwards:
        raise ValueError("trace has no worker 'forward' event: was the engine built with trace=True?")
    shown_steps = max(1, min(num_steps, len(forwards)))
    first = max(0, (len(forwards) - shown_steps) // 2)
    chosen = forwards[first:first + shown_steps]
    # Start a little before the first forward so the engine work that prepared it shows.
    span_s = chosen[-1].end - chosen[0].start
    lead_s = span_s / (2 * shown_steps) if shown_steps > 1 else chosen[0].duration * 0.25
    return Window(chosen[0].start - lead_s, chosen[-1].end, shown_steps)


# Pipeline stages waiting on each other: drawn, but not counted as busy.
WAIT_EVENTS = ("wait_hidden", "send_hidden", "wait_tokens")


def lanes_of(events: Sequence[TraceEvent]) -> list[tuple[str, list[TraceEvent]]]:
    """(label, events) per drawn lane, top to bottom: the engine, then the worker, or one lane per
    pipeline stage when the worker events carry a "stage" (tensor/pipeline-parallel runs)."""
    worker = [e for e in events if e.lane == "worker"]
    stages = sorted({e.args["stage"] for e in worker if "stage" in e.args})
    lanes = [("engine", [e for e in events if e.lane == "engine"])]
    if not stages:
        return [*lanes, ("worker", worker)]
    return [*lanes, *((f"stage {k}", [e for e in worker if e.args.get("stage") == k]) for k in stages)]


def _color_for(name: str, assigned: dict[str, str]) -> str:
    if name not in assigned:
        assigned[name] = KNOWN_COLORS.get(name, EXTRA_COLORS[len(assigned) % len(EXTRA_COLORS)])
    return assigned[name]


def plot_timelines(
    runs: Sequence[tuple[str, Sequence[TraceEvent]]],
    path: str | Path,
    num_steps: int = 8,
    title: str | None = None,
) -> Path:
    """Draw each run's engine and worker lanes over num_steps steady-state steps into a PNG.

    Events shorter than MIN_VISIBLE of the axis are drawn at that width (busy figures use true times).
    """
    if not runs:
        raise ValueError("plot_timelines needs at least one run")
    windows = [steady_window(events, num_steps) for _, events in runs]
    xmax_ms = max(window.length for window in windows) * 1e3
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.9 * len(runs) + 0.8), squeeze=False)
    colors: dict[str, str] = {}
    for ax, (label, events), window in zip(axes[:, 0], runs, windows, strict=True):
        lanes = lanes_of(events)
        for row, (_, lane_events) in enumerate(reversed(lanes)):  # worker (stages) at the bottom, engine on top
            for event in lane_events:
                if event.end < window.start or event.start > window.end:
                    continue
                start, end = max(event.start, window.start), min(event.end, window.end)
                # Events under 0.2% of the axis are widened to that, or sub-millisecond engine work
                # next to a 600 ms forward pass would not show at all.
                width_ms = max((end - start) * 1e3, MIN_VISIBLE * xmax_ms)
                ax.broken_barh([((start - window.start) * 1e3, width_ms)], (row - 0.35, 0.7),
                               facecolors=_color_for(event.name, colors), edgecolor="white", linewidth=0.3)
        busy_text = []
        for name, lane_events in lanes[1:]:
            working = [e for e in lane_events if e.name not in WAIT_EVENTS]
            busy = busy_seconds(working, "worker", window.start, window.end) / window.length if window.length > 0 else 0.0
            busy_text.append(f"{name} busy {busy:.0%}")
        ms_per_step = window.length * 1e3 / window.num_steps
        ax.set_title(f"{label}: {', '.join(busy_text)} of the window, {ms_per_step:.1f} ms/step",
                     loc="left", fontsize=10)
        ax.set_yticks(range(len(lanes)), [name for name, _ in reversed(lanes)])
        ax.set_ylim(-0.6, len(lanes) - 0.4)
        ax.set_xlim(0, xmax_ms)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time in window (ms)")
    handles = [Patch(color=color, label=name) for name, color in colors.items()]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 7), fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
