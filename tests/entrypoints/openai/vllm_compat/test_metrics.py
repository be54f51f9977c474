"""vLLM's test_metrics.py (the text model, default server) against `stepahead serve --metrics-prefix vllm`.

The server is shared with the folder's other files, so counts are read as differences around this test's
own requests (vLLM's server is fresh)."""

from __future__ import annotations

import threading

import httpx

from tests.entrypoints.openai.server_utils import metric, parse_metrics, wait_until
from tests.entrypoints.openai.vllm_compat.conftest import MODEL

PROMPT = "Hello my name is Robert and I love magic"
# vLLM's list, less the families it hides by default (deprecated names).
EXPECTED = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits", "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:iteration_tokens_total", "vllm:cache_config_info", "vllm:request_success_total",
    *(f"vllm:{family}_{suffix}" for family in (
        "request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_params_max_tokens",
        "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds") for suffix in ("sum", "bucket", "count")),
]


def _metrics(http) -> dict[str, float]:
    resp = http.get("/metrics")
    assert resp.status_code == 200
    return parse_metrics(resp.text)


def test_metrics_counts(client, http, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    num_requests, max_tokens = 10, 10
    before = _metrics(http)
    for _ in range(num_requests):
        out = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=max_tokens, temperature=0.0)
        assert out.choices[0].finish_reason == "length"  # so every request generated max_tokens, as vLLM's
    after = _metrics(http)
    n_prompt, n_out = len(prompt_ids), num_requests * max_tokens
    expected = {
        **{f"vllm:{name}_count": num_requests for name in (
            "time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
            "request_inference_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
            "request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_params_max_tokens")},
        "vllm:request_prompt_tokens_sum": num_requests * n_prompt,
        "vllm:request_generation_tokens_sum": n_out,
        "vllm:request_params_max_tokens_sum": n_out,
        "vllm:iteration_tokens_total_sum": num_requests * n_prompt + n_out,
        "vllm:iteration_tokens_total_count": n_out,  # one step per token: the prefill's and each decode's
        "vllm:prompt_tokens_total": num_requests * n_prompt,
        "vllm:generation_tokens_total": n_out,
        "vllm:request_success_total": num_requests,
    }
    got = {name: metric(after, name) - metric(before, name) for name in expected}
    assert got == expected


def test_metrics_exist(client, http):
    client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5, temperature=0.0)
    text = http.get("/metrics").text
    assert [name for name in EXPECTED if name not in text] == []


def _running(http) -> tuple[float, float, float]:
    m = _metrics(http)
    return (metric(m, "vllm:num_requests_running"), metric(m, "vllm:num_requests_waiting"),
            metric(m, "vllm:kv_cache_usage_perc"))


def test_abort_metrics_reset(compat_server, http, tokenizer):
    """Three long requests are running (each has streamed a token), then their clients go away: the
    running and waiting gauges and the KV usage go back to zero."""
    assert _running(http) == (0, 0, 0)
    body = {"model": MODEL, "prompt": tokenizer.encode(PROMPT), "max_tokens": 400, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    started, release = threading.Barrier(4), threading.Event()

    def stream_then_drop() -> None:
        with httpx.Client(base_url=compat_server.url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()  # kept open: dropping the iterator would close the stream, aborting the request
            next(lines)
            started.wait()
            release.wait()

    threads = [threading.Thread(target=stream_then_drop) for _ in range(3)]
    for t in threads:
        t.start()
    started.wait()
    # The gauges follow the engine's steps: wait for a snapshot taken while the requests run.
    seen_running = wait_until(lambda: _running(http)[0] > 0 and _running(http)[2] > 0)
    release.set()
    for t in threads:
        t.join()
    assert seen_running
    assert wait_until(lambda: _running(http) == (0, 0, 0))
