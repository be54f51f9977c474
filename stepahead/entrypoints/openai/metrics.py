"""Prometheus metrics on /metrics, with vLLM's names under the `stepahead:` prefix.

Engine-side numbers (queue sizes, KV blocks, prefix cache, preemptions, token totals, wasted steps,
worker utilization, speculative decoding's acceptance) come from the latest EngineStats snapshot, read at scrape time by a custom
collector. Latencies (TTFT, inter-token, end-to-end) and finished requests by reason are measured
here, in the API process, as the outputs arrive (vLLM does the same in its frontend).
Each app gets its own registry, so several servers in one process never collide. `--metrics-prefix
vllm` serves every family under `vllm:` instead, for dashboards built for vLLM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stepahead.config import CacheConfig
from stepahead.engine.async_llm import IterationStats
from stepahead.outputs import EngineStats

logger = logging.getLogger("stepahead.entrypoints.openai")

PREFIX = "stepahead:"
METRICS_PREFIXES = {"stepahead": "stepahead:", "vllm": "vllm:"}
FINISH_REASONS = ("stop", "length", "abort", "error")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_PARAMS_N_BUCKETS = [1.0, 2.0, 5.0, 10.0, 20.0]
# The request phases (queue, prefill, decode, inference) use E2E_BUCKETS, as vLLM does.
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]


def _token_buckets(max_model_len: int) -> list[float]:
    """1-2-5 buckets up to the context length."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(float(mantissa * scale))
        scale *= 10


class EngineStatsCollector(Collector):
    """Exposes the latest EngineStats snapshot at scrape time, and the KV cache's configuration."""

    def __init__(self, get_stats: Callable[[], EngineStats], model_name: str, prefix: str = PREFIX,
                 cache_config: CacheConfig | None = None) -> None:
        self._get_stats = get_stats
        self._labels = {"model_name": model_name}
        self._prefix = prefix
        self._cache_config = cache_config

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        if self._cache_config is not None:
            yield self._cache_config_info(stats)
        yield self._gauge("num_requests_running", "Requests in model-execution batches.", stats.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", stats.kv_cache_usage)
        yield self._gauge("kv_cache_free_blocks", "KV-cache blocks in the free pool.", stats.num_free_blocks)
        yield self._gauge("kv_cache_total_blocks", "Usable KV-cache blocks.", stats.num_total_blocks)
        yield self._gauge("host_utilization", "Worker host time in step calls / wall time while the engine had work.",
                          stats.utilization)
        yield self._gauge("gpu_utilization", "Device time of the steps (CUDA events; on CPU the host time) / wall "
                          "time while the engine had work.", stats.gpu_utilization)
        yield self._counter("prefix_cache_queries", "Prefix-cache lookups, in tokens.", stats.prefix_cache_queries)
        yield self._counter("prefix_cache_hits", "Prefix-cache hits, in tokens.", stats.prefix_cache_hits)
        yield self._counter("num_preemptions", "Cumulative preemptions.", stats.preemptions)
        yield self._counter("prompt_tokens", "Prefill tokens processed.", stats.prompt_tokens)
        yield self._counter("generation_tokens", "Generation tokens processed.", stats.generation_tokens)
        yield self._counter("forward_steps", "Non-empty steps executed by the worker.", stats.forward_steps)
        yield self._counter("wasted_request_steps",
                            "Request slots computed for requests that had already finished.", stats.wasted_request_steps)
        yield self._counter("host_busy_seconds", "Worker host time in step calls.", stats.busy_s)
        yield self._counter("gpu_busy_seconds", "Device time of the steps (on CPU the host time).", stats.gpu_busy_s)
        yield self._counter("engine_busy_wall_seconds", "Wall time during which the engine had work.", stats.wall_s)
        yield from self._spec_decode(stats)

    def _spec_decode(self, stats: EngineStats) -> Iterator[Metric]:
        """Speculative decoding's acceptance, as vLLM counts it (0 without speculation)."""
        yield self._counter("spec_decode_num_drafts", "Request-steps that verified draft tokens.", stats.spec_num_drafts)
        yield self._counter("spec_decode_num_draft_tokens", "Draft tokens verified.", stats.spec_num_draft_tokens)
        yield self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            stats.spec_num_accepted_tokens)
        family = CounterMetricFamily(self._prefix + "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in their step's drafts (0-based).",
                                     labels=[*self._labels, "position"])
        for pos, accepted in enumerate(stats.spec_accepted_per_pos):
            family.add_metric([*self._labels.values(), str(pos)], accepted)
        yield family

    def _cache_config_info(self, stats: EngineStats) -> GaugeMetricFamily:
        """vLLM's info gauge: value 1, the configuration in the labels (the pool as the worker sized it)."""
        assert self._cache_config is not None
        labels = {name: str(value) for name, value in dataclasses.asdict(self._cache_config).items()}
        labels["num_gpu_blocks"] = str(stats.num_total_blocks)
        family = GaugeMetricFamily(self._prefix + "cache_config_info", "Information of the KV-cache configuration.",
                                   labels=list(labels))
        family.add_metric(list(labels.values()), 1.0)
        return family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(self._prefix + name, doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(self._prefix + name, doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family


class ServerMetrics:
    """The registry of one server; `record` is an AsyncLLM stats listener."""

    def __init__(self, model_name: str, max_model_len: int, get_stats: Callable[[], EngineStats],
                 prefix: str = PREFIX, cache_config: CacheConfig | None = None,
                 max_num_batched_tokens: int | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(get_stats, model_name, prefix, cache_config))

        def histogram(name: str, doc: str, buckets: list[float]):
            return Histogram(prefix + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token, from arrival.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Gap between successive outputs.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        tokens = _token_buckets(max_model_len)
        self.req_prompt = histogram("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.req_gen = histogram("request_generation_tokens", "Generated tokens per request (choice).", tokens)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step.",
                                          _token_buckets(max_num_batched_tokens or max_model_len))
        self.queue_time = histogram("request_queue_time_seconds", "Time in the waiting queue, arrival to first "
                                    "scheduled.", E2E_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      E2E_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.", E2E_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to finish (prefill "
                                        "and decode).", E2E_BUCKETS)
        self.params_n = histogram("request_params_n", "The n of finished requests.", REQUEST_PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "The max_tokens of finished requests.", tokens)
        self.success = Counter(prefix + "request_success", "Finished requests (choices) by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # present (at 0) from the start, so rates work from the first scrape
            self.success.labels(model_name, reason)

    def record(self, iteration: IterationStats, engine_stats: EngineStats | None) -> None:
        for ttft_s in iteration.ttfts_s:
            self.ttft.observe(ttft_s)
        for itl_s in iteration.itls_s:
            self.itl.observe(itl_s)
        for num_tokens in iteration.step_tokens:
            self.iteration_tokens.observe(num_tokens)
        for finished in iteration.finished:
            self.success.labels(self.model_name, finished.finish_reason).inc()
            if finished.finish_reason != "abort":
                self.e2e.observe(finished.e2e_s)
                self.req_prompt.observe(finished.num_prompt_tokens)
                self.req_gen.observe(finished.num_generation_tokens)
                self.params_n.observe(finished.n)
                if finished.max_tokens is not None:
                    self.params_max_tokens.observe(finished.max_tokens)
                for phase, seconds in ((self.queue_time, finished.queue_s), (self.prefill_time, finished.prefill_s),
                                       (self.decode_time, finished.decode_s),
                                       (self.inference_time, finished.inference_s)):
                    if seconds is not None:
                        phase.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def log_stats_periodically(get_stats: Callable[[], EngineStats], interval_s: float = 10.0) -> None:
    """vLLM's periodic engine line, skipped while the engine is idle and nothing changed."""
    previous, previous_time = get_stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        current, now = get_stats(), time.monotonic()
        elapsed_s = max(now - previous_time, 1e-9)
        prompt_tokens = current.prompt_tokens - previous.prompt_tokens
        generated_tokens = current.generation_tokens - previous.generation_tokens
        if prompt_tokens or generated_tokens or current.num_running or current.num_waiting:
            queries = current.prefix_cache_queries - previous.prefix_cache_queries
            hits = current.prefix_cache_hits - previous.prefix_cache_hits
            # On CPU the device time is the host time: the line gives the host figure alone there.
            gpu = f", GPU utilization: {100 * current.gpu_utilization:.1f}%" if current.times_device else ""
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, "
                        "Host utilization: %.1f%%%s", prompt_tokens / elapsed_s, generated_tokens / elapsed_s,
                        current.num_running, current.num_waiting, 100 * current.kv_cache_usage,
                        100 * hits / queries if queries else 0.0, 100 * current.utilization, gpu)
        previous, previous_time = current, now
