"""Speculative decoding's counters on /metrics, with vLLM's names under the stepahead: prefix."""

from __future__ import annotations

from prometheus_client import generate_latest

from stepahead.entrypoints.openai.metrics import ServerMetrics
from stepahead.outputs import EngineStats


def test_acceptance_counters_and_per_position():
    stats = EngineStats(spec_num_drafts=10, spec_num_draft_tokens=30, spec_num_accepted_tokens=16,
                        spec_accepted_per_pos=[8, 5, 3])
    text = generate_latest(ServerMetrics("m", 64, lambda: stats).registry).decode()
    lines = set(text.splitlines())
    assert 'stepahead:spec_decode_num_drafts_total{model_name="m"} 10.0' in lines
    assert 'stepahead:spec_decode_num_draft_tokens_total{model_name="m"} 30.0' in lines
    assert 'stepahead:spec_decode_num_accepted_tokens_total{model_name="m"} 16.0' in lines
    for pos, n in enumerate([8, 5, 3]):
        assert f'stepahead:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{pos}"}} {n}.0' in lines
    assert stats.spec_mean_accepted_length == 1 + 16 / 10 and stats.spec_acceptance_rate == 16 / 30


def test_bench_serve_reads_the_run_acceptance_from_metrics():
    from stepahead.bench import spec_counters

    def scraped(stats):
        return spec_counters.parse(generate_latest(ServerMetrics("m", 64, lambda: stats).registry).decode())

    before = scraped(EngineStats(spec_num_drafts=4, spec_num_draft_tokens=12, spec_num_accepted_tokens=2))
    after = scraped(EngineStats(spec_num_drafts=14, spec_num_draft_tokens=42, spec_num_accepted_tokens=22))
    assert spec_counters.acceptance(before, after) == {"spec_num_drafts": 10, "spec_num_draft_tokens": 30,
                                                       "spec_num_accepted_tokens": 20,
                                                       "spec_mean_accepted_length": 3.0}
    assert spec_counters.acceptance(before, before) is None  # no drafting in the run
    assert spec_counters.parse("# nothing here\n") is None


def test_server_with_ngram_drafts_reports_acceptance(tiny_model_factory):
    """`stepahead serve --speculative-config ...`: completions as without drafts, acceptance on /metrics."""
    import httpx

    from stepahead import LLM, SamplingParams
    from tests.entrypoints.openai.conftest import SERVER_ARGS
    from tests.entrypoints.openai.server_utils import RemoteServer, metric, parse_metrics

    tied = tiny_model_factory("llama", tie_word_embeddings=True)  # repeats itself: drafts hit
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    prompt = [5, 6, 7, 8, 5, 6, 7, 8]
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    srv = RemoteServer(tied, *SERVER_ARGS, "--speculative-config", spec)
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            drafted = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
            metrics = parse_metrics(http.get("/metrics").text)
    finally:
        srv.stop()
    accepted = metric(metrics, "stepahead:spec_decode_num_accepted_tokens_total")
    assert accepted > 0
    # One sample per draft position.
    assert metric(metrics, "stepahead:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert metric(metrics, "stepahead:spec_decode_num_accepted_tokens_per_pos_total", position="2") >= 0
    # The text plain decoding gives (offline: the same engine without a server around it).
    with LLM(str(tied), executor="uni", dtype="float32") as llm:
        (plain,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=16, temperature=0),
                                use_tqdm=False)
    assert drafted == plain.outputs[0].text
