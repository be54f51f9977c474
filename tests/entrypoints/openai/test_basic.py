"""Health, version, models, tokenize/detokenize and /metrics on the shared server."""

from __future__ import annotations

import pytest

from stepahead.entrypoints.openai.api_server import stepahead_version
from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.entrypoints.openai.server_utils import metric, parse_metrics, wait_until

REQUIRED_METRICS = [
    "stepahead:num_requests_running", "stepahead:num_requests_waiting", "stepahead:kv_cache_usage_perc",
    "stepahead:prefix_cache_queries_total", "stepahead:prefix_cache_hits_total", "stepahead:num_preemptions_total",
    "stepahead:prompt_tokens_total", "stepahead:generation_tokens_total", "stepahead:request_success_total",
    "stepahead:wasted_request_steps_total", "stepahead:host_utilization", "stepahead:gpu_utilization",
    "stepahead:time_to_first_token_seconds_count", "stepahead:inter_token_latency_seconds_count",
    "stepahead:e2e_request_latency_seconds_count",
    # vLLM's request phases and parameters, and the engine steps' sizes.
    "stepahead:iteration_tokens_total_count", "stepahead:request_queue_time_seconds_count",
    "stepahead:request_prefill_time_seconds_count", "stepahead:request_decode_time_seconds_count",
    "stepahead:request_inference_time_seconds_count", "stepahead:request_params_n_count",
    "stepahead:request_params_max_tokens_count",
]


def test_health_and_version(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.content == b""
    assert http.get("/version").json() == {"version": stepahead_version()}


def test_models(http, client, tiny_llama):
    data = http.get("/v1/models").json()
    assert data["object"] == "list"
    (card,) = data["data"]
    assert card["id"] == MODEL_NAME and card["object"] == "model"
    assert card["root"] == str(tiny_llama)
    assert card["max_model_len"] == 512
    assert [m.id for m in client.models.list()] == [MODEL_NAME]


def test_tokenize_detokenize_roundtrip(http):
    r = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "import os\nprint(os.getcwd())",
                                     "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) > 0
    assert r["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "import os\nprint(os.getcwd())"}


def test_metrics_exposed_with_model_label(http):
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = parse_metrics(r.text)
    for name in REQUIRED_METRICS:
        assert metric(m, name, model_name=MODEL_NAME) >= 0, name


def _idle(http) -> bool:
    return metric(parse_metrics(http.get("/metrics").text), "stepahead:num_requests_running") == 0


def test_metrics_move_when_requests_run(http, client):
    assert wait_until(lambda: _idle(http))
    before = parse_metrics(http.get("/metrics").text)
    out = client.completions.create(model=MODEL_NAME, prompt="for i in range(10):", max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert wait_until(lambda: _idle(http))
    after = parse_metrics(http.get("/metrics").text)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("stepahead:generation_tokens_total") == out.usage.completion_tokens == 7
    assert delta("stepahead:prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("stepahead:request_success_total", finished_reason="length") == 1
    assert delta("stepahead:time_to_first_token_seconds_count") == 1
    assert delta("stepahead:e2e_request_latency_seconds_count") == 1
    assert 1 <= delta("stepahead:inter_token_latency_seconds_count") <= 6
    assert delta("stepahead:request_generation_tokens_sum") == 7
    assert delta("stepahead:prefix_cache_queries_total") >= 0
    assert delta("stepahead:forward_steps_total") >= 7
    assert 0 < metric(after, "stepahead:host_utilization") <= 1
    assert 0 < metric(after, "stepahead:gpu_utilization") <= 1  # on CPU the host time again
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"stepahead:request_{phase}_time_seconds_count") == 1, phase
    assert 0 <= delta("stepahead:request_queue_time_seconds_sum") <= delta("stepahead:e2e_request_latency_seconds_sum")
    assert delta("stepahead:request_inference_time_seconds_sum") == pytest.approx(
        delta("stepahead:request_prefill_time_seconds_sum") + delta("stepahead:request_decode_time_seconds_sum"))
    assert delta("stepahead:request_params_n_count") == 1 and delta("stepahead:request_params_max_tokens_sum") == 7
    # Every computed token is in some step: the prompt once, and each output but the last fed back.
    assert delta("stepahead:iteration_tokens_total_sum") >= out.usage.prompt_tokens + 6
    assert delta("stepahead:iteration_tokens_total_count") == delta("stepahead:forward_steps_total")
    assert metric(after, "stepahead:cache_config_info", block_size="16", enable_prefix_caching="True",
                  num_gpu_blocks="127") == 1  # --num-kv-blocks 128, the null block aside


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version", "/v1/models"])
def test_get_endpoints_need_no_body(http, path):
    assert http.get(path).status_code == 200
