"""Baselines of the distributed tests: the same prompts on one rank (uni executor, float32)."""

from __future__ import annotations

import random

import pytest

from stepahead import LLM, SamplingParams

MAX_TOKENS = 10
MAX_MODEL_LEN = 128


def prompts() -> list[dict]:
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(3, 2048) for _ in range(n)]} for n in (5, 19, 40, 33)]


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
SEEDED = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7 + i) for i in range(len(prompts()))]


def token_ids(llm: LLM, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_factory):
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="session")
def single_rank_tokens(tiny_llama, tiny_qwen3):
    """{arch: (greedy, seeded)} with one rank."""
    out = {}
    for arch, folder in (("llama", tiny_llama), ("qwen3", tiny_qwen3)):
        with LLM(str(folder), executor="uni", max_model_len=MAX_MODEL_LEN) as llm:
            out[arch] = (token_ids(llm, GREEDY), token_ids(llm, SEEDED))
    return out


@pytest.fixture(scope="module")
def local_ray_cluster():
    """A local Ray cluster for the module's tests (skipped where ray is not installed)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
