"""Tensor- and pipeline-parallel runs on real worker ranks (gloo, CPU) give the tokens one rank gives.

float32 tiny models; every configuration is compared with the single-rank (uni) baseline, greedy and
seeded sampling. With P pipeline stages the batch queue is P deep (P + 1 with async scheduling), so
the pipeline configurations also check the placeholder and EOS-waste accounting at depth 2 and 3.
"""

from __future__ import annotations

import pytest

from stepahead import LLM, SamplingParams
from stepahead.bench.plot import lanes_of
from stepahead.distributed.layer_partition import PARTITION_ENV
from tests.distributed.conftest import GREEDY, MAX_MODEL_LEN, MAX_TOKENS, SEEDED, prompts, token_ids
from tests.tiny_models import GEMMA_ARCHS, hf_greedy, hf_prompt_logprobs, phi3_longrope

CONFIGS = {
    "tp2": dict(tensor_parallel_size=2),  # async, depth 2
    "pp2_async": dict(pipeline_parallel_size=2),  # depth 3
    "pp2_sync": dict(pipeline_parallel_size=2, async_scheduling=False),  # depth 2
    "tp2_pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2),  # 4 ranks, depth 3
}
# Finishes on a stop token: the steps already in flight for the request are wasted. Async scheduling
# schedules a request into every step in flight (depth - 1 wasted); sync never schedules it twice.
EXPECTED_WASTE_PER_STOP = {"tp2": 1, "pp2_async": 2, "pp2_sync": 0}


def _stop_params(greedy: list[list[int]]) -> list[SamplingParams]:
    """A stop token per prompt: its greedy output's first token at index >= 3 not seen before."""
    params = []
    for toks in greedy:
        i = next(i for i in range(3, len(toks)) if toks[i] not in toks[:i])
        params.append(SamplingParams(max_tokens=MAX_MODEL_LEN // 2, temperature=0.0, stop_token_ids=[toks[i]]))
    return params


@pytest.mark.parametrize("name", list(CONFIGS))
def test_llama_parallel_equals_one_rank(tiny_llama, single_rank_tokens, name):
    greedy, seeded = single_rank_tokens["llama"]
    with LLM(str(tiny_llama), max_model_len=MAX_MODEL_LEN, **CONFIGS[name]) as llm:
        p = llm.config.parallel_config
        assert llm.config.max_concurrent_batches == p.pipeline_parallel_size + int(llm.config.async_scheduling)
        assert token_ids(llm, GREEDY) == greedy
        if name == "tp2_pp2":
            return  # four ranks on the build machine's cores: greedy only, to keep the suite short
        assert token_ids(llm, SEEDED) == seeded
        before = llm.stats().wasted_request_steps
        outs = llm.generate(prompts(), _stop_params(greedy), use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "stop" for o in outs)
        assert llm.stats().wasted_request_steps - before == EXPECTED_WASTE_PER_STOP[name] * len(outs)


@pytest.mark.parametrize("partition", [None, "1,2"])
def test_uneven_pipeline_stages_equal_one_rank(tiny_model_factory, monkeypatch, partition):
    """Three layers at PP=2: vLLM's split (2, 1), or STEPAHEAD_PP_LAYER_PARTITION's (1, 2)."""
    folder = str(tiny_model_factory("llama", num_hidden_layers=3))
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    with LLM(folder, executor="uni", max_model_len=MAX_MODEL_LEN) as llm:
        greedy = token_ids(llm, GREEDY)
    if partition is not None:
        monkeypatch.setenv(PARTITION_ENV, partition)
    with LLM(folder, max_model_len=MAX_MODEL_LEN, pipeline_parallel_size=2) as llm:
        assert llm.config.parallel_config.pp_layer_partition == (None if partition is None else (1, 2))
        assert token_ids(llm, GREEDY) == greedy


def test_qwen3_tensor_parallel_equals_one_rank(tiny_qwen3, single_rank_tokens):
    greedy, seeded = single_rank_tokens["qwen3"]
    with LLM(str(tiny_qwen3), max_model_len=MAX_MODEL_LEN, tensor_parallel_size=2) as llm:
        assert token_ids(llm, GREEDY) == greedy
        assert token_ids(llm, SEEDED) == seeded


@pytest.mark.parametrize("name", ["tp2", "pp2_async"])
def test_phi3_parallel_matches_transformers(tiny_model_factory, name):
    """Phi-3's fused qkv_proj and gate_up_proj, each tensor rank reading its heads and intermediate slice
    out of every part, each stage its layers; LongRoPE and partial rope as Phi-4-mini."""
    folder = tiny_model_factory("phi3", **phi3_longrope(MAX_MODEL_LEN))
    with LLM(str(folder), max_model_len=MAX_MODEL_LEN, **CONFIGS[name]) as llm:
        assert token_ids(llm, GREEDY) == hf_greedy(folder, [p["prompt_token_ids"] for p in prompts()], MAX_TOKENS)


def test_pipeline_depth3_preemption_and_abort_in_flight(tiny_llama, single_rank_tokens):
    """At PP=2 depth 3 with a pool too small for every request: preemption (and the stale outputs of
    steps still in flight when a request is preempted) and an abort while its steps are in flight
    leave the other requests' tokens as one rank computes them."""
    greedy, seeded = single_rank_tokens["llama"]
    with LLM(str(tiny_llama), max_model_len=MAX_MODEL_LEN, pipeline_parallel_size=2, num_kv_blocks=10,
             trace=True) as llm:
        assert llm.config.max_concurrent_batches == 3
        stream = llm.generate_stream(prompts()[2], SamplingParams(max_tokens=40, temperature=0.0))
        for _ in range(3):
            next(stream)
        stream.close()  # aborted with steps in flight
        assert token_ids(llm, GREEDY) == greedy
        assert token_ids(llm, SEEDED) == seeded
        assert llm.stats().preemptions > 0
        # The timeline has a lane per stage: the first stage's events arrive with the sampler's outputs.
        lanes = dict(lanes_of(llm.drain_trace_events()))
        assert list(lanes) == ["engine", "stage 0", "stage 1"]
        assert {"forward", "send_hidden"} <= {e.name for e in lanes["stage 0"]}
        assert {"wait_hidden", "forward", "sample"} <= {e.name for e in lanes["stage 1"]}


@pytest.mark.parametrize("name", ["tp2", "pp2_async"])
@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_gemma_parallel_matches_transformers(tiny_model_factory, arch, name):
    """Two ranks of a Gemma model give transformers' greedy ids: each with half the heads of a
    windowed and a global layer (the caps applied to whole rows once gathered), or one layer each
    (the windowed layer on the first stage, the global one and the tied head on the second)."""
    folder = tiny_model_factory(arch)
    with LLM(str(folder), max_model_len=MAX_MODEL_LEN, **CONFIGS[name]) as llm:
        got = token_ids(llm, GREEDY)
    assert got == hf_greedy(folder, [p["prompt_token_ids"] for p in prompts()], GREEDY.max_tokens)


@pytest.mark.parametrize("arch, name", [("qwen3_moe", "tp2"), ("mixtral", "tp2"), ("mixtral", "pp2_async")])
def test_moe_parallel_equals_one_rank(tiny_model_factory, arch, name):
    """TP: each rank holds every expert's half of the intermediate features (and Qwen3-MoE's dense
    layer its half of the MLP), one all-reduce per MoE block. PP: each stage its layers' experts."""
    folder = str(tiny_model_factory(arch))
    with LLM(folder, executor="uni", max_model_len=MAX_MODEL_LEN) as llm:
        greedy, seeded = token_ids(llm, GREEDY), token_ids(llm, SEEDED)
    with LLM(folder, max_model_len=MAX_MODEL_LEN, **CONFIGS[name]) as llm:
        assert token_ids(llm, GREEDY) == greedy
        assert token_ids(llm, SEEDED) == seeded


@pytest.mark.parametrize("name", ["tp2", "pp2_async"])
def test_prompt_logprobs_across_ranks(tiny_llama, name):
    """Every last-stage tensor rank computes the prompt rows' logits (their all-gather needs all of them);
    the sampling rank reports them: the values of one transformers forward, chunked prefill included."""
    ids = [p["prompt_token_ids"] for p in prompts()]
    reference = hf_prompt_logprobs(tiny_llama, ids, 3)
    with LLM(str(tiny_llama), max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16, **CONFIGS[name]) as llm:
        outs = llm.generate(prompts(), SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3),
                            use_tqdm=False)
    for out, ref in zip(outs, reference, strict=True):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ref)
        for entries, expected in zip(out.prompt_logprobs[1:], ref[1:], strict=True):
            assert {t: v.rank for t, v in entries.items()} == {t: r for t, (_, r) in expected.items()}
            assert {t: v.logprob for t, v in entries.items()} == pytest.approx(
                {t: lp for t, (lp, _) in expected.items()}, abs=1e-4)
