"""Sliding-window checkpoints run at their whole context: greedy ids equal transformers' float32 on
tiny models whose window is shorter than prompt + output, and chunked prefill and a prefix-cache hit
give the plain run's ids."""

from __future__ import annotations

import random

import pytest

from stepahead import LLM, SamplingParams
from stepahead.models.loading.loader import load_model_config
from tests.tiny_models import hf_greedy, llm_greedy

MAX_TOKENS = 24
PROMPT_LENS = (5, 19, 40, 70)
# (arch, config overrides): every layer windowed (Mistral); the first layer full, the second windowed (Qwen2)
WINDOWED = {
    "mistral": dict(sliding_window=12),
    "qwen2": dict(sliding_window=9, use_sliding_window=True, max_window_layers=1),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in PROMPT_LENS]


def _generate(folder, prompts, **engine) -> list[list[int]]:
    return llm_greedy(folder, prompts, MAX_TOKENS, **engine)


@pytest.mark.parametrize("arch", sorted(WINDOWED))
def test_windowed_greedy_matches_transformers(tiny_model_factory, arch, attention_path):
    folder = tiny_model_factory(arch, **WINDOWED[arch])
    config = load_model_config(str(folder), "cpu")
    assert config.max_model_len == 512  # max_position_embeddings, not the window
    assert any(w is not None for w in config.sliding_windows)
    prompts = _prompts()
    expected = hf_greedy(folder, prompts, MAX_TOKENS)
    assert _generate(folder, prompts, block_size=16) == expected
    # chunks of 8 tokens (windows end mid-chunk), blocks of 4 (a window spans several)
    assert _generate(folder, prompts, block_size=4, max_num_batched_tokens=8, max_num_seqs=2) == expected


@pytest.mark.parametrize("arch", sorted(WINDOWED))
def test_a_prefix_cache_hit_equals_the_plain_run(tiny_model_factory, arch):
    """A second prompt sharing the first's 48 tokens reads them from the prefix cache."""
    folder = tiny_model_factory(arch, **WINDOWED[arch])
    base = _prompts()[3]
    longer = base[:48] + [7, 8, 9, 10, 11]
    plain = _generate(folder, [longer], block_size=16, enable_prefix_caching=False)
    with LLM(str(folder), executor="uni", block_size=16) as llm:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": base}], params, use_tqdm=False)
        hit = llm.generate([{"prompt_token_ids": longer}], params, use_tqdm=False)
        assert llm.stats().prefix_cache_hits > 0
    assert [hit[0].outputs[0].token_ids] == plain


def test_blocks_out_of_every_window_return_to_the_pool(tiny_model_factory):
    """Every Mistral layer is windowed: as a request moves on, the KV blocks wholly before its window go
    back to the pool (null blocks take their place in its table), and the output is still transformers'."""
    folder = tiny_model_factory("mistral", **WINDOWED["mistral"])
    prompts = _prompts()
    with LLM(str(folder), executor="uni", block_size=4, max_num_batched_tokens=8, max_num_seqs=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
        kv = llm.engine_core.scheduler.kv_cache_manager
        assert kv.num_window_freed_blocks > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(folder, prompts, MAX_TOKENS)
