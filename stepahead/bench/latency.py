"""`stepahead bench latency`: one batch end to end, repeated, plus the per-step latency distribution.

vLLM's latency benchmark (batch of random prompts, ignore_eos, avg/std/percentiles of the batch
latency), with what the trace adds: every worker step's duration and the step period (forward start
to next forward start: the cadence a client sees), split into steps that hold prefill tokens and
pure decode steps. With the synchronous scheduler the period exceeds the worker's step by the
engine's bookkeeping; with the step-ahead scheduler the two converge.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from stepahead.bench.datasets import random_token_requests
from stepahead.bench.report import distribution_ms
from stepahead.bench.throughput import add_output_args, drain_spans, emit_outputs, make_llm, mode_label
from stepahead.bench.trace import Span


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


def worker_steps(spans: list[Span]) -> list[WorkerStep]:
    """Group the worker lane into steps: prepare_inputs, forward, sample (in that order, one of each)."""
    steps, cur = [], {}
    for s in (s for s in spans if s.lane == "worker"):
        if s.name == "prepare_inputs":
            cur = {"prepare_inputs": s}
        elif s.name in ("forward", "sample") and cur:
            cur[s.name] = s
            if s.name == "sample" and "forward" in cur:
                p = cur["prepare_inputs"]
                steps.append(WorkerStep(p.start, cur["forward"].start, s.end, int(p.args.get("num_reqs", 0)),
                                        int(p.args.get("num_tokens", 0))))
                cur = {}
    return steps


def step_figures(runs: list[list[WorkerStep]]) -> dict:
    """Worker step time and step period, each for prefill-holding and pure decode steps.

    Periods are taken within each run only: the gap between two generate() calls is no step.
    """
    periods: dict[str, list[float]] = {"prefill": [], "decode": []}
    for steps in runs:
        for a, b in zip(steps, steps[1:], strict=False):
            periods["decode" if a.is_decode else "prefill"].append(b.forward_start - a.forward_start)
    out = {}
    for phase in ("prefill", "decode"):
        durations = [s.duration for steps in runs for s in steps if s.is_decode == (phase == "decode")]
        out[phase] = {"worker_step": distribution_ms(durations), "step_period": distribution_ms(periods[phase])}
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--batch-size", type=int, default=8, help="prompts in the batch (default: %(default)s)")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens (default: %(default)s)")
    g.add_argument("--output-len", type=int, default=128, help="generated tokens (default: %(default)s)")
    g.add_argument("--num-iters-warmup", type=int, default=1, help="(default: %(default)s)")
    g.add_argument("--num-iters", type=int, default=3, help="timed batches (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=1.0, help="(default: %(default)s, as vLLM's)")
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
    llm = make_llm(engine_args, None, trace=True)  # the per-step figures come from the trace
    latencies, steps = [], []
    label = mode_label(llm)
    try:
        vocab = llm.config.model_config.vocab_size
        special = list(getattr(llm.get_tokenizer(), "all_special_ids", []) or [])
        params = SamplingParams(max_tokens=ns.output_len, temperature=ns.temperature, ignore_eos=True)
        for i in range(ns.num_iters_warmup + ns.num_iters):
            # A new seed per batch: no prefix-cache hit from the previous iteration.
            reqs = random_token_requests(ns.batch_size, (ns.input_len,) * 2, (ns.output_len,) * 2, vocab,
                                         ns.seed + i, special)
            drain_spans(llm)
            t0 = time.perf_counter()
            llm.generate([r.engine_prompt() for r in reqs], params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            spans = drain_spans(llm)
            if i >= ns.num_iters_warmup:
                latencies.append(elapsed)
                steps.append(worker_steps(spans))
                last_spans = spans
    finally:
        llm.shutdown()
    lat = np.asarray(latencies)
    percentiles = {p: float(np.percentile(lat, p)) for p in (10, 25, 50, 75, 90, 99)}
    figures = step_figures(steps)
    print(f"[{label}] batch {ns.batch_size} x ({ns.input_len} in, {ns.output_len} out), {ns.num_iters} iterations")
    print(f"Avg latency: {lat.mean():.4f} seconds")
    print(f"Std latency: {lat.std():.4f} seconds")
    for p, v in percentiles.items():
        print(f"{p}% percentile latency: {v:.4f} seconds")
    for phase, f in figures.items():
        w, per = f["worker_step"], f["step_period"]
        print(f"{phase:>7} steps: {w['count']:4d}  worker step mean {w['mean_ms']:.2f} / median {w['median_ms']:.2f} "
              f"/ p99 {w['p99_ms']:.2f} ms;  step period mean {per['mean_ms']:.2f} / median "
              f"{per['median_ms']:.2f} / p99 {per['p99_ms']:.2f} ms")
    run = _LatencyRun(label, last_spans, float(lat[-1]))
    summary = {"avg_latency": float(lat.mean()), "std_latency": float(lat.std()), "latencies": latencies,
               "percentiles": percentiles, "steps": figures}
    emit_outputs(ns, "latency", engine_args, {"runs": [run], "summary": summary})
    return 0


@dataclass
class _LatencyRun:
    """The last iteration, in the shape emit_outputs reads (label, spans, to_dict, plot_label)."""

    label: str
    spans: list[Span]
    elapsed_s: float

    def plot_label(self) -> str:
        return f"{self.label} (batch latency {self.elapsed_s:.2f} s)"

    def to_dict(self) -> dict:
        return {"label": self.label, "elapsed_s": self.elapsed_s}
