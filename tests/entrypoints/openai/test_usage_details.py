"""vLLM's smaller fields on a server of their own (flags that change every response):
--enable-prompt-tokens-details (usage.prompt_tokens_details.cached_tokens from the prefix cache),
stream_options.continuous_usage_stats, and --max-logprobs -1 with logprobs / top_logprobs -1 (the whole
vocabulary); /tokenize's token_strs; --metrics-prefix vllm."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer, metric, parse_metrics
from tests.tiny_models import VOCAB_SIZE

NAME = "tiny"
PROMPT = "def main(argv):\n    parser = argparse.ArgumentParser(description=__doc__)\n    parser.add_argument("


@pytest.fixture(scope="module")
def http(tiny_llama):
    server = RemoteServer(tiny_llama, "--served-model-name", NAME, "--dtype", "float32", "--executor", "uni",
                          "--enable-prompt-tokens-details", "--max-logprobs", "-1", "--block-size", "16",
                          "--metrics-prefix", "vllm")
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client
    server.stop()


def _post(http, path: str, **body) -> dict:
    r = http.post(path, json={"model": NAME, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_cached_tokens_count_the_prefix_cache_hit(http):
    tokens = _post(http, "/tokenize", prompt=PROMPT)["tokens"]
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    first = _post(http, "/v1/completions", **body)["usage"]
    second = _post(http, "/v1/completions", **body)["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}  # the first test: nothing cached yet
    # The second run finds every whole block of the prompt but the one holding its last token.
    assert second["prompt_tokens_details"]["cached_tokens"] == (len(tokens) - 1) // 16 * 16 > 0
    chat = _post(http, "/v1/chat/completions", messages=[{"role": "user", "content": PROMPT}], max_tokens=2)
    assert "cached_tokens" in chat["usage"]["prompt_tokens_details"]


def test_continuous_usage_stats(http):
    chunks = []
    with http.stream("POST", "/v1/completions", json={
            "model": NAME, "prompt": "hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    token_chunks = [c for c in chunks if c["choices"]]
    assert token_chunks and all(c["usage"] is not None for c in token_chunks)
    completion_tokens = [c["usage"]["completion_tokens"] for c in token_chunks]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_whole_vocabulary_logprobs(http):
    out = _post(http, "/v1/completions", prompt="hello", max_tokens=2, temperature=0, logprobs=-1)
    top = out["choices"][0]["logprobs"]["top_logprobs"]
    assert len(top) == 2 and all(len(entry) > VOCAB_SIZE // 2 for entry in top)  # distinct token texts
    chat = _post(http, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                 temperature=0, logprobs=True, top_logprobs=-1)
    assert all(len(entry["top_logprobs"]) == VOCAB_SIZE for entry in chat["choices"][0]["logprobs"]["content"])


def test_tokenize_always_has_token_strs(http):
    plain = _post(http, "/tokenize", prompt="hello world")
    assert "token_strs" in plain and plain["token_strs"] is None
    asked = _post(http, "/tokenize", prompt="hello world", return_token_strs=True)
    assert len(asked["token_strs"]) == asked["count"]


def test_metrics_under_vllm_names(http):
    _post(http, "/v1/completions", prompt="hello", max_tokens=3, temperature=0)
    text = http.get("/metrics").text
    assert "stepahead:" not in text
    metrics = parse_metrics(text)
    for name in ("vllm:num_requests_running", "vllm:prompt_tokens_total", "vllm:iteration_tokens_total_count",
                 "vllm:request_queue_time_seconds_count", "vllm:request_params_max_tokens_count",
                 "vllm:time_to_first_token_seconds_count"):
        assert metric(metrics, name) >= 1 or name == "vllm:num_requests_running", name
    assert metric(metrics, "vllm:cache_config_info", block_size="16") == 1
