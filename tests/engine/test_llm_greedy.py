"""LLM.generate greedy token ids equal transformers' float32 greedy, for every supported family."""

from __future__ import annotations

import random

import pytest

from stepahead import LLM, SamplingParams
from tests.tiny_models import ARCHS, hf_greedy

MAX_TOKENS = 10
# Lengths that end inside, exactly at, and past block boundaries of 16 and 32.
PROMPT_LENS = (3, 16, 17, 33, 70)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(tiny_model_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = hf_greedy(tiny_model_factory(arch), _prompts(), MAX_TOKENS)
        return cache[arch]

    return get


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_model_factory, references, arch, block_size):
    with LLM(str(tiny_model_factory(arch)), executor="uni", block_size=block_size, max_model_len=256) as llm:
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == _prompts()
    assert [o.outputs[0].token_ids for o in outs] == references(arch)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
