"""Mixtures of experts (Qwen3-MoE, Mixtral) through LLM: greedy token ids equal transformers' float32
greedy, and stay the same one prompt at a time, in a batch, with chunked prefill and with preemption."""

from __future__ import annotations

import random

import pytest

from stepahead import LLM, SamplingParams
from tests.tiny_models import hf_greedy

MAX_TOKENS = 10
MAX_MODEL_LEN = 96
# name -> (tiny arch, config overrides)
MODELS = {
    "qwen3_moe": ("qwen3_moe", {}),  # top 2 of 8, not renormalised; layer 1 dense (mlp_only_layers)
    # top 3 renormalised (norm_topk_prob); only layer 1 sparse (decoder_sparse_step 2)
    "qwen3_moe_step2": ("qwen3_moe", dict(num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=2,
                                          mlp_only_layers=())),
    "mixtral": ("mixtral", {}),
}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
CONFIGS = {
    "chunked": dict(max_num_batched_tokens=8),
    # 7 usable blocks of 16 tokens for prompts ending a token short of a block: requests preempt each other
    "preempt": dict(num_kv_blocks=8),
    "preempt_sync": dict(num_kv_blocks=8, async_scheduling=False),
    # the CUDA configuration's attention kernels and async outputs, through Triton's interpreter
    "triton": dict(attention_backend="triton", async_output=True),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in (15, 31, 47, 14, 30, 3)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    def get(name: str):
        arch, overrides = MODELS[name]
        return tiny_model_factory(arch, **overrides)
    return get


@pytest.fixture(scope="module")
def reference(model):
    cache: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            cache[name] = hf_greedy(model(name), _prompts(), MAX_TOKENS)
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_matches_transformers_batched_and_alone(model, reference, name):
    with LLM(str(model(name)), executor="uni", max_model_len=MAX_MODEL_LEN) as llm:
        batched = _greedy(llm, _prompts())
        alone = [_greedy(llm, [p])[0] for p in _prompts()]
    assert batched == reference(name)
    assert alone == batched


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_chunked_and_preempted_runs_equal_the_plain_run(model, reference, name, config):
    with LLM(str(model(name)), executor="uni", max_model_len=MAX_MODEL_LEN, **CONFIGS[config]) as llm:
        assert _greedy(llm, _prompts()) == reference(name)
        if config.startswith("preempt"):
            assert llm.stats().preemptions > 0
