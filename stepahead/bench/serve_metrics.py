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
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "request_goodput": None,  # vLLM's key; no --goodput SLOs here
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        "max_output_tokens_per_s": peak_output_tokens_per_s(ok),
        "max_concurrent_requests": peak_concurrency(ok),
    }
    for name in METRICS:
        a = np.asarray(samples[name] or [0.0], dtype=np.float64) * 1e3
        if name not in selected:
            continue
        out[f"mean_{name}_ms"] = float(a.mean())
        out[f"median_{name}_ms"] = float(np.median(a))
        out[f"std_{name}_ms"] = float(a.std())
        for p in percentiles:
            out[f"p{_pct_name(p)}_{name}_ms"] = float(np.percentile(a, p))
    return out


def _pct_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def token_times(r: RequestResult) -> list[float]:
    """Absolute times of the token chunks of one request (first token, then each ITL gap)."""
    t = r.start_time + r.ttft
    times = [t]
    for gap in r.itl:
        t += gap
        times.append(t)
    return times


def peak_output_tokens_per_s(ok: Sequence[RequestResult]) -> float:
    """Most token chunks in any whole second of the run (vLLM counts one token per chunk here too)."""
    if not ok:
        return 0.0
    t0 = min(r.start_time for r in ok)
    buckets: dict[int, int] = {}
    for r in ok:
        for t in token_times(r):
            b = int(t - t0)
            buckets[b] = buckets.get(b, 0) + 1
    return float(max(buckets.values()))


def peak_concurrency(ok: Sequence[RequestResult]) -> int:
    """Sweep line over [start, start + latency] intervals."""
    edges = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok],
                   key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in edges:
        cur += d
        best = max(best, cur)
    return best


def format_result(m: dict, max_concurrency: int | None, request_rate: float, percentiles: Sequence[float],
                  selected: Sequence[str]) -> str:
    """vLLM's printout: labels left-justified to 40 characters, values with two decimals."""
    def row(label: str, value) -> str:
        v = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
        return f"{label:<40}{v}"

    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines.append(row("Successful requests:", m["completed"]))
    lines.append(row("Failed requests:", m["failed"]))
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(row("Request rate configured (RPS):", float(request_rate)))
    lines.append(row("Benchmark duration (s):", m["duration"]))
    lines.append(row("Total input tokens:", m["total_input_tokens"]))
    lines.append(row("Total generated tokens:", m["total_output_tokens"]))
    lines.append(row("Request throughput (req/s):", m["request_throughput"]))
    lines.append(row("Output token throughput (tok/s):", m["output_throughput"]))
    lines.append(row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"]))
    lines.append(row("Peak concurrent requests:", m["max_concurrent_requests"]))
    lines.append(row("Total token throughput (tok/s):", m["total_token_throughput"]))
    for name in METRICS:
        if name not in selected:
            continue
        header, short = LABELS[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(row(f"Mean {short} (ms):", m[f"mean_{name}_ms"]))
        lines.append(row(f"Median {short} (ms):", m[f"median_{name}_ms"]))
        for p in percentiles:
            lines.append(row(f"P{_pct_name(p)} {short} (ms):", m[f"p{_pct_name(p)}_{name}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)
