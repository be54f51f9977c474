"""`stepahead bench throughput` and `bench latency` end to end on a tiny model (real engine, real transformers)."""

from __future__ import annotations

import json

import pytest

from stepahead.entrypoints.cli import main

ENGINE = ["--max-model-len", "128", "--max-num-seqs", "8", "--num-kv-blocks", "96"]
WORKLOAD = ["--num-prompts", "6", "--input-len", "4:24", "--output-len", "3:12", "--seed", "1"]


def _expected_output_tokens() -> int:
    from stepahead.bench.datasets import random_token_requests
    from tests.tiny_models import SPECIAL_TOKENS, VOCAB_SIZE

    reqs = random_token_requests(6, (4, 24), (3, 12), VOCAB_SIZE, 1, range(len(SPECIAL_TOKENS)))
    return sum(r.expected_output_len for r in reqs)


def test_compare_sync_writes_json_trace_and_plot(tiny_llama, tmp_path, capsys):
    out = tmp_path / "tp.json"
    trace, png = tmp_path / "trace.json", tmp_path / "img" / "tl.png"
    rc = main(["bench", "throughput", "--model", str(tiny_llama), *ENGINE, *WORKLOAD, "--compare", "sync",
               "--rounds", "2", "--json", str(out), "--trace", str(trace), "--plot", str(png), "--plot-steps", "4"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "async / sync =" in printed and "round 2/2" in printed
    # On CPU the device time is the host time: one figure, named for what it is.
    assert "host utilization" in printed and "GPU utilization" not in printed
    data = json.loads(out.read_text())
    assert data["benchmark"] == "throughput" and data["command"].startswith("stepahead ")
    runs = data["runs"]
    assert sorted(r["label"] for r in runs) == ["async", "async", "sync", "sync"]
    want = _expected_output_tokens()
    for r in runs:
        # ignore_eos: every request produces exactly its budget, in both modes.
        assert r["output_tokens"] == want and r["num_requests"] == 6
        assert r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"]
        assert 0 < r["host_utilization"] <= 1.0 and 0 < r["gpu_utilization"] <= 1.0 and r["forward_steps"] > 0
        assert r["wasted_request_steps"] == 0 and r["stop_finishes"] == 0 and r["device"] == "cpu"
    assert {r["prompt_tokens"] for r in runs} == {runs[0]["prompt_tokens"]}
    s = data["summary"]
    assert len(s["ratios"]) == 2 and s["ratio_median"] > 0
    assert s["async"]["output_tok_s_median"] > 0 and s["sync"]["output_tok_s_median"] > 0

    events = json.loads(trace.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(procs.values()) == ["async", "sync"] and procs[1] == "sync"  # sync listed first
    for pid in procs:
        spans = [e for e in events if e["ph"] == "X" and e["pid"] == pid]
        lanes = {e["cat"] for e in spans}
        assert lanes == {"engine", "worker"}
        assert sum(e["name"] == "forward" for e in spans) == sum(e["name"] == "sample" for e in spans) > 0
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert set(data["summary"]["worker_gaps"]) == {"sync", "async"}
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_compare_transformers_same_token_counts(tiny_llama, tmp_path, capsys):
    out = tmp_path / "hf.json"
    rc = main(["bench", "throughput", "--model", str(tiny_llama), *ENGINE, *WORKLOAD, "--compare", "transformers",
               "--hf-batch-size", "4", "--json", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())["summary"]
    want = _expected_output_tokens()
    assert s["stepahead"]["output_tokens"] == want
    names = [b["name"] for b in s["transformers"]]
    assert any("generate_batch" in n for n in names) and any("static batches of 4" in n for n in names)
    for b in s["transformers"]:
        assert b["output_tokens"] == want and b["prompt_tokens"] == s["stepahead"]["prompt_tokens"]
        assert b["output_tok_s"] > 0
    assert all(r > 0 for r in s["ratios"].values())
    assert "stepahead / transformers generate_batch" in capsys.readouterr().out


def test_latency_splits_prefill_and_decode_steps(tiny_llama, tmp_path, capsys):
    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--model", str(tiny_llama), *ENGINE, "--batch-size", "3", "--input-len", "10",
               "--output-len", "6", "--num-iters-warmup", "1", "--num-iters", "2", "--json", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())["summary"]
    assert len(s["latencies"]) == 2 and s["avg_latency"] > 0
    steps = s["steps"]
    # The 3 prompts fit one step: per batch, 1 prefill step then 5 decode steps (one per further token).
    assert steps["prefill"]["worker_step"]["count"] == 2
    assert steps["decode"]["worker_step"]["count"] == 2 * 5
    assert steps["decode"]["step_period"]["count"] == 2 * 4  # periods only within a batch
    assert steps["decode"]["worker_step"]["median_ms"] > 0
    assert "Avg latency:" in capsys.readouterr().out


def test_latency_breakdown_splits_the_worker_step(tiny_llama, tmp_path, capsys):
    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--model", str(tiny_llama), *ENGINE, "--batch-size", "2", "--input-len", "8",
               "--output-len", "4", "--num-iters-warmup", "0", "--num-iters", "1", "--breakdown",
               "--quantization", "int4", "--json", str(out)])
    assert rc == 0
    parts = json.loads(out.read_text())["summary"]["breakdown_ms_per_step"]
    assert set(parts) == {"matmul", "attention", "kv_write", "kv_gather", "other_layers", "output_head",
                          "sampler", "host"}
    assert parts["matmul"] > 0 and parts["kv_write"] > 0 and parts["output_head"] > 0
    assert all(value >= 0 for value in parts.values())
    assert "breakdown over 4 worker steps" in capsys.readouterr().out


@pytest.mark.parametrize("flags, field", [
    (["--rounds", "0", "--compare", "sync"], "rounds"),
    (["--num-prompts", "0"], "num_prompts"),
])
def test_bad_arguments_name_the_field(tiny_llama, flags, field, capsys):
    rc = main(["bench", "throughput", "--model", str(tiny_llama), *ENGINE, *flags])
    assert rc == 2 and field in capsys.readouterr().err


def test_bad_length_range_is_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--input-len", "9:3"])
    assert "MIN <= MAX" in capsys.readouterr().err


def test_compare_nospec_on_the_copy_workload(tiny_model_factory, tmp_path, capsys):
    """Drafts against none on the copy-heavy prompts: the same tokens, fewer steps, the acceptance reported."""
    tied = tiny_model_factory("llama", tie_word_embeddings=True)  # repeats itself: drafts hit
    out = tmp_path / "spec.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    rc = main(["bench", "throughput", "--model", str(tied), "--max-model-len", "512", "--max-num-seqs", "2",
               "--dataset", "copy", "--num-prompts", "3", "--output-len", "16:16", "--temperature", "0",
               "--speculative-config", spec, "--compare", "nospec", "--rounds", "1", "--json", str(out)])
    assert rc == 0
    assert "spec / nospec =" in capsys.readouterr().out
    data = json.loads(out.read_text())
    runs = {r["label"]: r for r in data["runs"]}
    assert runs["spec"]["output_tokens"] == runs["nospec"]["output_tokens"] == 3 * 16
    assert runs["spec"]["forward_steps"] < runs["nospec"]["forward_steps"]
    assert runs["spec"]["mean_accepted_length"] > 1 and runs["nospec"]["mean_accepted_length"] == 0
    assert data["workload"]["dataset"] == "copy"
    assert data["summary"]["spec"]["mean_accepted_length"] == [runs["spec"]["mean_accepted_length"]]


def test_compare_nospec_needs_a_speculative_config(tiny_llama, capsys):
    rc = main(["bench", "throughput", "--model", str(tiny_llama), *ENGINE, *WORKLOAD, "--compare", "nospec"])
    assert rc != 0
    assert "--compare nospec needs --speculative-config" in capsys.readouterr().err


def test_compare_spec_measures_one_proposer_against_another(tiny_model_factory, tmp_path, capsys):
    """Suffix against n-gram drafts, alternating: both engines' drafts are counted, the tokens the same."""
    tied = tiny_model_factory("llama", tie_word_embeddings=True)
    out = tmp_path / "spec.json"
    rc = main(["bench", "throughput", "--model", str(tied), "--max-model-len", "512", "--max-num-seqs", "2",
               "--dataset", "copy", "--num-prompts", "3", "--output-len", "16:16", "--temperature", "0",
               "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 3}', "--compare", "spec",
               "--baseline-speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
               "--rounds", "1", "--json", str(out)])
    assert rc == 0
    assert "spec / baseline =" in capsys.readouterr().out
    data = json.loads(out.read_text())
    runs = {r["label"]: r for r in data["runs"]}
    assert runs["spec"]["output_tokens"] == runs["baseline"]["output_tokens"] == 3 * 16
    assert runs["spec"]["mean_accepted_length"] > 1 and runs["baseline"]["mean_accepted_length"] > 1


def test_compare_spec_needs_a_baseline(tiny_llama, capsys):
    rc = main(["bench", "throughput", "--model", str(tiny_llama), *ENGINE, *WORKLOAD, "--compare", "spec",
               "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 3}'])
    assert rc != 0 and "baseline-speculative-config" in capsys.readouterr().err
