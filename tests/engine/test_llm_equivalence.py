"""The same prompts give the same tokens whatever the engine configuration (greedy and seeded sampling).

Baseline: async scheduling, batch-queue depth 2, prefix caching and chunked prefill on, uni executor.
Each other configuration changes one thing (or two: preemption under sync scheduling).
"""

from __future__ import annotations

import random

import pytest

from stepahead import LLM, SamplingParams
from tests.tiny_models import hf_greedy

MAX_TOKENS = 12
MAX_MODEL_LEN = 128


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    base = [[rng.randrange(3, 2048) for _ in range(n)] for n in (5, 19, 40, 64)]
    # A repeat and a shared 32-token prefix: the prefix cache has something to find.
    return base + [list(base[2]), base[3][:32] + [rng.randrange(3, 2048) for _ in range(9)]]


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
SEEDED = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=100 + i) for i in range(len(_prompts()))]
# Penalties read every earlier output id: with async outputs the worker must wait for the last step's.
PENALIZED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4,
                           repetition_penalty=1.3, logprobs=2)

CONFIGS = {
    "sync": dict(async_scheduling=False),
    "depth3": dict(max_concurrent_batches=3),
    "preempt": dict(num_kv_blocks=10),
    "preempt_sync": dict(num_kv_blocks=10, async_scheduling=False),
    "chunked": dict(max_num_batched_tokens=8),
    "chunked_sync": dict(max_num_batched_tokens=8, async_scheduling=False),
    "no_prefix_cache": dict(enable_prefix_caching=False),
    "mp": dict(executor="mp"),
    # The CUDA configuration's mechanisms on CPU: outputs resolved off the worker's call path, and the
    # Triton attention kernels (through Triton's interpreter).
    "async_output": dict(async_output=True),
    "async_output_mp": dict(async_output=True, executor="mp"),
    "async_output_preempt": dict(async_output=True, num_kv_blocks=10),
    "triton": dict(attention_backend="triton", async_output=True),
}


def _run(model, **overrides):
    kwargs = dict(executor="uni", max_model_len=MAX_MODEL_LEN) | overrides
    with LLM(str(model), **kwargs) as llm:
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        seeded = [o.outputs[0].token_ids for o in llm.generate(prompts, SEEDED, use_tqdm=False)]
        penalized = [(o.outputs[0].token_ids, [{i: v.logprob for i, v in lp.items()} for lp in o.outputs[0].logprobs])
                     for o in llm.generate(prompts, PENALIZED, use_tqdm=False)]
        return greedy, (seeded, penalized), llm.stats(), llm.config


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    return _run(tiny_llama)


def test_baseline_is_async_and_matches_transformers(tiny_llama, baseline):
    greedy, seeded, stats, config = baseline
    assert config.async_scheduling and config.max_concurrent_batches == 2
    assert greedy == hf_greedy(tiny_llama, _prompts(), MAX_TOKENS)
    assert stats.prefix_cache_hits > 0  # the repeat, the shared prefix, and the second pass
    assert stats.preemptions == 0
    seeded, penalized = seeded
    assert all(len(s) == MAX_TOKENS for s in seeded)
    assert seeded != greedy
    assert [tokens for tokens, _ in penalized] != greedy


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_tokens_across_configs(tiny_llama, baseline, name):
    greedy, seeded, stats, config = _run(tiny_llama, **CONFIGS[name])
    assert greedy == baseline[0]
    (seeded, penalized), (base_seeded, base_penalized) = seeded, baseline[1]
    assert seeded == base_seeded
    assert [tokens for tokens, _ in penalized] == [tokens for tokens, _ in base_penalized]
    for (_, logprobs), (_, base_logprobs) in zip(penalized, base_penalized, strict=True):
        assert [lp.keys() for lp in logprobs] == [lp.keys() for lp in base_logprobs]
        assert logprobs == [pytest.approx(lp, abs=1e-4) for lp in base_logprobs]
    if name.startswith("preempt"):
        assert stats.preemptions > 0
    if name.endswith("sync"):
        assert not config.async_scheduling and config.max_concurrent_batches == 1
    if name == "no_prefix_cache":
        assert stats.prefix_cache_hits == 0
    if name.startswith("async_output") or name == "triton":
        assert config.async_output
    if name == "triton":
        assert config.attention_backend == "triton"
    if name.startswith("chunked"):
        assert config.scheduler_config.max_num_batched_tokens == 8


@pytest.mark.parametrize("is_async", [True, False])
def test_priorities_preempting_each_other_give_the_same_tokens(tiny_llama, baseline, is_async):
    """Under the priority policy, with a pool too small for every request, urgent requests take the blocks
    of running ones (preempting them with steps in flight): every request keeps its tokens."""
    priorities = [3, 0, 2, 1, 0, 4]
    with LLM(str(tiny_llama), executor="uni", max_model_len=MAX_MODEL_LEN, scheduling_policy="priority",
             num_kv_blocks=10, async_scheduling=is_async) as llm:
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, priority=priorities)]
        seeded = [o.outputs[0].token_ids for o in llm.generate(prompts, SEEDED, use_tqdm=False, priority=priorities)]
        assert llm.config.scheduler_config.scheduling_policy == "priority"
        assert llm.stats().preemptions > 0
    assert greedy == baseline[0]
    assert seeded == baseline[1][0]
