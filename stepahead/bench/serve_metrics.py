"""vLLM's serving metrics (`vllm bench serve`): definitions, the printout and the result-file keys."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    """What one streamed request measured (times in seconds from perf_counter)."""

    prompt_len: int = 0
    output_tokens: int = 0
    success: bool = False
    start_time: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0  # send -> last token chunk (the usage chunk does not extend it)
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""


METRICS = ("ttft", "tpot", "itl", "e2el")
LABELS = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
          "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}


def compute_metrics(results: Sequence[RequestResult], duration: float, percentiles: Sequence[float],
                    selected: Sequence[str]) -> dict:
    """vLLM's result dict for the completed requests of one run (keys as in its --save-result file)."""
    completed = [result for result in results if result.success]
    total_in = sum(result.prompt_len for result in completed)
    total_out = sum(result.output_tokens for result in completed)
    samples = {
        "ttft": [result.ttft for result in completed],
        "tpot": [(result.latency - result.ttft) / (result.output_tokens - 1) for result in completed
                 if result.output_tokens > 1],
        "itl": [gap for result in completed for gap in result.itl],
        "e2el": [result.latency for result in completed],
    }
    metrics = {
        "duration": duration,
        "completed": len(completed),
        "failed": len(results) - len(completed),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(completed) / duration if duration > 0 else 0.0,
        "request_goodput": None,  # vLLM's key; no --goodput SLOs here
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        "max_output_tokens_per_s": peak_output_tokens_per_s(completed),
        "max_concurrent_requests": peak_concurrency(completed),
    }
    for name in METRICS:
        values_ms = np.asarray(samples[name] or [0.0], dtype=np.float64) * 1e3
        if name not in selected:
            continue
        metrics[f"mean_{name}_ms"] = float(values_ms.mean())
        metrics[f"median_{name}_ms"] = float(np.median(values_ms))
        metrics[f"std_{name}_ms"] = float(values_ms.std())
        for percent in percentiles:
            metrics[f"p{_pct_name(percent)}_{name}_ms"] = float(np.percentile(values_ms, percent))
    return metrics


def _pct_name(percent: float) -> str:
    return str(int(percent)) if float(percent).is_integer() else str(percent)


def token_times(result: RequestResult) -> list[float]:
    """Absolute times of the token chunks of one request (first token, then each ITL gap)."""
    now = result.start_time + result.ttft
    times = [now]
    for gap in result.itl:
        now += gap
        times.append(now)
    return times


def peak_output_tokens_per_s(completed: Sequence[RequestResult]) -> float:
    """Most token chunks in any whole second of the run (vLLM counts one token per chunk here too)."""
    if not completed:
        return 0.0
    run_start = min(result.start_time for result in completed)
    chunks_per_second: dict[int, int] = {}
    for result in completed:
        for when in token_times(result):
            second = int(when - run_start)
            chunks_per_second[second] = chunks_per_second.get(second, 0) + 1
    return float(max(chunks_per_second.values()))


def peak_concurrency(completed: Sequence[RequestResult]) -> int:
    """Sweep line over [start, start + latency] intervals."""
    edges = sorted([(result.start_time, 1) for result in completed]
                   + [(result.start_time + result.latency, -1) for result in completed])
    running = peak = 0
    for _, change in edges:
        running += change
        peak = max(peak, running)
    return peak


def format_result(metrics: dict, max_concurrency: int | None, request_rate: float, percentiles: Sequence[float],
                  selected: Sequence[str]) -> str:
    """vLLM's printout: labels left-justified to 40 characters, values with two decimals."""
    def row(label: str, value) -> str:
        shown = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
        return f"{label:<40}{shown}"

    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines.append(row("Successful requests:", metrics["completed"]))
    lines.append(row("Failed requests:", metrics["failed"]))
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(row("Request rate configured (RPS):", float(request_rate)))
    lines.append(row("Benchmark duration (s):", metrics["duration"]))
    lines.append(row("Total input tokens:", metrics["total_input_tokens"]))
    lines.append(row("Total generated tokens:", metrics["total_output_tokens"]))
    lines.append(row("Request throughput (req/s):", metrics["request_throughput"]))
    lines.append(row("Output token throughput (tok/s):", metrics["output_throughput"]))
    lines.append(row("Peak output token throughput (tok/s):", metrics["max_output_tokens_per_s"]))
    lines.append(row("Peak concurrent requests:", metrics["max_concurrent_requests"]))
    lines.append(row("Total token throughput (tok/s):", metrics["total_token_throughput"]))
    for name in METRICS:
        if name not in selected:
            continue
        header, short = LABELS[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(row(f"Mean {short} (ms):", metrics[f"mean_{name}_ms"]))
        lines.append(row(f"Median {short} (ms):", metrics[f"median_{name}_ms"]))
        for percent in percentiles:
            lines.append(row(f"P{_pct_name(percent)} {short} (ms):", metrics[f"p{_pct_name(percent)}_{name}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)
