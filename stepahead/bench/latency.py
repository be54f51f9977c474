"""`stepahead bench latency`: one batch end to end, repeated, plus the per-step latency distribution.

vLLM's latency benchmark (batch of random prompts, ignore_eos, avg/std/percentiles of the batch
latency), with what the trace adds: every worker step's duration and the step period (forward start
to next forward start: the cadence a client sees), split into steps that hold prefill tokens and
pure decode steps. With the synchronous scheduler the period exceeds the worker's step by the
engine's bookkeeping; with the step-ahead scheduler the two converge.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from stepahead.bench.breakdown import Timers, hooked, split
from stepahead.bench.datasets import random_token_requests
from stepahead.bench.report import distribution_ms
from stepahead.bench.throughput import add_output_args, drain_events, emit_outputs, make_llm, mode_label
from stepahead.tracing import TraceEvent


@dataclass
class WorkerStep:
    start: float  # prepare_inputs start
    forward_start: float
    end: float  # sample end
    num_reqs: int
    num_tokens: int

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == self.num_reqs  # one token per request: nothing left to prefill

    @property
    def duration(self) -> float:
        return self.end - self.start


def worker_steps(events: list[TraceEvent]) -> list[WorkerStep]:
    """Group the worker lane into steps: prepare_inputs, forward, sample (in that order, one of each)."""
    steps: list[WorkerStep] = []
    current: dict[str, TraceEvent] = {}  # the events of the step being read, by name
    for event in (event for event in events if event.lane == "worker"):
        if event.name == "prepare_inputs":
            current = {"prepare_inputs": event}
        elif event.name in ("forward", "sample") and current:
            current[event.name] = event
            if event.name == "sample" and "forward" in current:
                prepare = current["prepare_inputs"]
                steps.append(WorkerStep(prepare.start, current["forward"].start, event.end,
                                        int(prepare.args.get("num_reqs", 0)), int(prepare.args.get("num_tokens", 0))))
                current = {}
    return steps


def step_figures(runs: list[list[WorkerStep]]) -> dict:
    """Worker step time and step period, each for prefill-holding and pure decode steps.

    Periods are taken within each run only: the gap between two generate() calls is no step.
    """
    periods: dict[str, list[float]] = {"prefill": [], "decode": []}
    for steps in runs:
        for step, next_step in zip(steps, steps[1:], strict=False):
            periods["decode" if step.is_decode else "prefill"].append(next_step.forward_start - step.forward_start)
    figures = {}
    for phase in ("prefill", "decode"):
        durations = [step.duration for steps in runs for step in steps if step.is_decode == (phase == "decode")]
        figures[phase] = {"worker_step": distribution_ms(durations), "step_period": distribution_ms(periods[phase])}
    return figures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--batch-size", type=int, default=8, help="prompts in the batch (default: %(default)s)")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens (default: %(default)s)")
    g.add_argument("--output-len", type=int, default=128, help="generated tokens (default: %(default)s)")
    g.add_argument("--num-iters-warmup", type=int, default=1, help="(default: %(default)s)")
    g.add_argument("--num-iters", type=int, default=3, help="timed batches (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=1.0, help="(default: %(default)s, as vLLM's)")
    g.add_argument("--breakdown", action="store_true",
                   help="split the worker step into matmul, attention, KV write/gather, other layers, output head, "
                        "sampler and host time (runs the worker in this process: --executor uni)")
    add_output_args(parser)


def main(ns: argparse.Namespace) -> int:
    from stepahead.entrypoints.engine_flags import engine_args_from_namespace
    from stepahead.sampling_params import SamplingParams

    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(ns, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(ns, name)}")
    if ns.num_iters_warmup < 0:
        raise ValueError(f"num_iters_warmup must be >= 0, got {ns.num_iters_warmup}")
    engine_args = engine_args_from_namespace(ns)
    if ns.breakdown:
        engine_args = dataclasses.replace(engine_args, executor="uni")  # the hooks time this process's model
    llm = make_llm(engine_args, None, trace=True)  # the per-step figures come from the trace
    timers = Timers()
    latencies, steps = [], []
    last_events_all: list[TraceEvent] = []  # every timed iteration's events
    label = mode_label(llm)
    try:
        vocab = llm.config.model_config.vocab_size
        special = list(getattr(llm.get_tokenizer(), "all_special_ids", []) or [])
        params = SamplingParams(max_tokens=ns.output_len, temperature=ns.temperature, ignore_eos=True)
        for iteration in range(ns.num_iters_warmup + ns.num_iters):
            # A new seed per batch: no prefix-cache hit from the previous iteration.
            requests = random_token_requests(ns.batch_size, (ns.input_len,) * 2, (ns.output_len,) * 2, vocab,
                                             ns.seed + iteration, special)
            drain_events(llm)
            hooks = hooked(timers) if ns.breakdown and iteration >= ns.num_iters_warmup else contextlib.nullcontext()
            with hooks:
                started = time.perf_counter()
                llm.generate([request.engine_prompt() for request in requests], params, use_tqdm=False)
                elapsed = time.perf_counter() - started
            events = drain_events(llm)
            if iteration >= ns.num_iters_warmup:
                latencies.append(elapsed)
                steps.append(worker_steps(events))
                last_events = events
                last_events_all.extend(events)
    finally:
        llm.shutdown()
    latency_s = np.asarray(latencies)
    percentiles = {percent: float(np.percentile(latency_s, percent)) for percent in (10, 25, 50, 75, 90, 99)}
    figures = step_figures(steps)
    print(f"[{label}] batch {ns.batch_size} x ({ns.input_len} in, {ns.output_len} out), {ns.num_iters} iterations")
    print(f"Avg latency: {latency_s.mean():.4f} seconds")
    print(f"Std latency: {latency_s.std():.4f} seconds")
    for percent, value in percentiles.items():
        print(f"{percent}% percentile latency: {value:.4f} seconds")
    for phase, phase_figures in figures.items():
        worker, period = phase_figures["worker_step"], phase_figures["step_period"]
        print(f"{phase:>7} steps: {worker['count']:4d}  worker step mean {worker['mean_ms']:.2f} / median "
              f"{worker['median_ms']:.2f} / p99 {worker['p99_ms']:.2f} ms;  step period mean {period['mean_ms']:.2f} "
              f"/ median {period['median_ms']:.2f} / p99 {period['p99_ms']:.2f} ms")
    if ns.breakdown:
        summary_breakdown = _print_breakdown(timers, steps, last_events_all)
    run = _LatencyRun(label, last_events, float(latency_s[-1]))
    summary = {"avg_latency": float(latency_s.mean()), "std_latency": float(latency_s.std()), "latencies": latencies,
               "percentiles": percentiles, "steps": figures}
    if ns.breakdown:
        summary["breakdown_ms_per_step"] = summary_breakdown
    emit_outputs(ns, "latency", engine_args, {"runs": [run], "summary": summary})
    return 0


def _print_breakdown(timers: Timers, steps: list[list[WorkerStep]], events: list[TraceEvent]) -> dict[str, float]:
    num_steps = sum(len(run) for run in steps)
    step_s = sum(step.duration for run in steps for step in run)
    sample_s = sum(event.end - event.start for event in events if event.lane == "worker" and event.name == "sample")
    per_step = split(timers, step_s, sample_s, num_steps)
    total = sum(per_step.values()) or 1.0
    print(f"breakdown over {num_steps} worker steps, ms per step (share):")
    print("  " + ", ".join(f"{name} {ms:.2f} ({100 * ms / total:.0f}%)" for name, ms in per_step.items()))
    return per_step


@dataclass
class _LatencyRun:
    """The last iteration, in the shape emit_outputs reads (label, events, to_dict, plot_label)."""

    label: str
    events: list[TraceEvent]
    elapsed_s: float

    def plot_label(self) -> str:
        return f"{self.label} (batch latency {self.elapsed_s:.2f} s)"

    def to_dict(self) -> dict:
        return {"label": self.label, "elapsed_s": self.elapsed_s}
