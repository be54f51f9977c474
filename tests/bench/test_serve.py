"""`stepahead bench serve` against a real `stepahead serve` subprocess with a tiny model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stepahead.bench.serve import arrival_gaps, prompt_tokenizer
from stepahead.bench.serve_metrics import RequestResult, compute_metrics, format_result
from stepahead.entrypoints.cli import main
from tests.entrypoints.openai.server_utils import RemoteServer

VLLM_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests",
} | {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")}


SERVED_NAME = "tiny-llama"  # not a folder: the bench finds the tokenizer through the model's root


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = RemoteServer(tiny_llama, "--served-model-name", SERVED_NAME, "--max-model-len", "256",
                       "--num-kv-blocks", "128", "--max-num-seqs", "16")
    yield srv
    srv.stop()


def _bench(server, tiny_llama, tmp_path, *extra, tokenizer: bool = True):
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", server.url, *(["--tokenizer", str(tiny_llama)] if tokenizer else []),
               "--num-prompts", "10", "--random-input-len", "24", "--random-output-len", "8", "--ignore-eos",
               "--disable-tqdm", "--save-result", "--result-filename", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_completions_report_every_vllm_metric(server, tiny_llama, tmp_path, capsys):
    rc, res = _bench(server, tiny_llama, tmp_path, "--max-concurrency", "3", "--num-warmups", "2",
                     "--prompt-format", "token-ids")
    assert rc == 0
    assert VLLM_KEYS <= set(res)
    assert res["completed"] == 10 and res["failed"] == 0
    assert res["total_output_tokens"] == 10 * 8  # from the usage chunks; ignore_eos
    assert res["total_input_tokens"] == 10 * 24  # token-id prompts: exact lengths
    assert res["max_concurrency"] == 3 and 1 <= res["max_concurrent_requests"] <= 3
    assert res["model_id"] == SERVED_NAME and res["tokenizer_id"] == str(tiny_llama) and res["request_rate"] == "inf"
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms",
                "mean_e2el_ms", "p99_itl_ms"):
        assert res[key] > 0, key
    assert res["total_token_throughput"] > res["output_throughput"]
    assert res["mean_e2el_ms"] >= res["mean_ttft_ms"]
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Mean TPOT (ms):" in printed and "P99 E2EL (ms):" in printed


def test_chat_endpoint_with_poisson_arrivals(server, tiny_llama, tmp_path):
    rc, res = _bench(server, tiny_llama, tmp_path, "--endpoint", "/v1/chat/completions", "--request-rate", "40",
                     "--burstiness", "0.5", "--random-range-ratio", "0.25", "--save-detailed")
    assert rc == 0 and res["completed"] == 10 and res["backend"] == "openai-chat"
    assert res["request_rate"] == 40.0
    assert sum(res["output_lens"]) == res["total_output_tokens"]
    assert all(6 <= n <= 10 for n in res["output_lens"])  # 8 * (1 +- 0.25)
    assert all(len(itl) >= 1 for itl in res["itls"]) and all(t > 0 for t in res["ttfts"])


def test_tokenizer_comes_from_the_served_model(server, tiny_llama, tmp_path):
    """No --model, no --tokenizer: the first model of /v1/models, its tokenizer found by its root there."""
    rc, res = _bench(server, tiny_llama, tmp_path, "--num-prompts", "3", tokenizer=False)
    assert rc == 0 and res["completed"] == 3
    assert res["model_id"] == SERVED_NAME and res["tokenizer_id"] == str(tiny_llama)


def test_missing_tokenizer_is_one_clear_line(server, capsys):
    rc = main(["bench", "serve", "--base-url", server.url, "--model", "not-served", "--num-prompts", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "tokenizer not found" in err and "'not-served'" in err and "pass --tokenizer" in err


def test_tokenizer_sources_in_order(tiny_llama, tmp_path):
    """--tokenizer, else the model name when it is loadable, else the root the server reports."""
    _, source = prompt_tokenizer(None, str(tiny_llama), "/no/such/root")
    assert source == str(tiny_llama)
    _, source = prompt_tokenizer(None, SERVED_NAME, str(tiny_llama))
    assert source == str(tiny_llama)
    with pytest.raises(ValueError, match="not a local folder"):
        prompt_tokenizer(str(tmp_path / "missing"), SERVED_NAME, str(tiny_llama))  # an explicit flag is not overridden


def test_unknown_model_counts_failures(server, tiny_llama, tmp_path, capsys):
    rc, res = _bench(server, tiny_llama, tmp_path, "--model", "no-such-model")
    assert rc == 1 and res["completed"] == 0 and res["failed"] == 10
    assert "HTTP 404" in capsys.readouterr().out


def test_arrival_gaps_span_n_over_rate():
    gaps = arrival_gaps(50, rate=10.0, burstiness=0.3, seed=0)
    assert gaps[0] == 0 and np.all(gaps >= 0)
    assert gaps.sum() == pytest.approx(5.0)
    assert not np.allclose(gaps[1:], gaps[1])
    assert np.all(arrival_gaps(5, float("inf"), 1.0, 0) == 0)


def test_metric_definitions():
    a = RequestResult(prompt_len=10, output_tokens=5, success=True, start_time=0.0, ttft=0.1, latency=0.5,
                      itl=[0.1, 0.1, 0.1, 0.1])
    b = RequestResult(prompt_len=20, output_tokens=1, success=True, start_time=0.2, ttft=0.2, latency=0.2)
    c = RequestResult(prompt_len=7, error="HTTP 500")
    m = compute_metrics([a, b, c], duration=2.0, percentiles=[50, 99], selected=["ttft", "tpot", "itl", "e2el"])
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["output_throughput"] == pytest.approx(3.0) and m["total_token_throughput"] == pytest.approx(18.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4; b has one token and no TPOT
    assert m["mean_ttft_ms"] == pytest.approx(150.0) and m["p50_e2el_ms"] == pytest.approx(350.0)
    assert m["max_concurrent_requests"] == 2 and m["max_output_tokens_per_s"] == 6
    text = format_result(m, None, float("inf"), [50, 99], ["ttft", "tpot", "itl", "e2el"])
    assert "Maximum request concurrency" not in text and "P50 TTFT (ms):" in text


@pytest.mark.parametrize("flags, field", [
    (["--num-prompts", "0"], "num_prompts"),
    (["--request-rate", "0"], "request_rate"),
    (["--endpoint", "/v1/chat/completions", "--prompt-format", "token-ids"], "prompt_format"),
    (["--percentile-metrics", "ttft,bogus"], "percentile_metrics"),
])
def test_bad_arguments_name_the_field(flags, field, capsys):
    assert main(["bench", "serve", "--port", "9", *flags]) == 2
    assert field in capsys.readouterr().err
