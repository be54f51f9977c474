"""--kv-cache-dtype: what 'auto' picks, and a float16 cache under packed weights keeping the engine's
equivalences (async equal to sync, chunked to unchunked, cached prefixes to uncached, preempted to
unpreempted)."""

from __future__ import annotations

import random

import pytest

from stepahead import LLM, SamplingParams
from stepahead.engine.arg_utils import EngineArgs, resolve_kv_cache_dtype
from stepahead.kernels import cpu_build
from stepahead.validation import InvalidInputError

MAX_TOKENS = 10


def test_auto_is_float16_under_packed_weights_and_the_models_dtype_otherwise(tiny_llama):
    packed = EngineArgs(model=str(tiny_llama), quantization="int4", kv_cache_memory_bytes=1 << 20)
    dense = EngineArgs(model=str(tiny_llama), quantization="none", kv_cache_memory_bytes=1 << 20)
    packed_config, dense_config = packed.create_engine_config(), dense.create_engine_config()
    assert packed_config.cache_config.cache_dtype == "float16"
    assert dense_config.cache_config.cache_dtype == dense_config.model_config.dtype == "float32"
    # the same byte budget holds twice the blocks at two bytes a value (block 0 reserved in both)
    assert packed_config.cache_config.num_blocks == 2 * dense_config.cache_config.num_blocks
    explicit = EngineArgs(model=str(tiny_llama), quantization="int4", kv_cache_dtype="float32")
    assert explicit.create_engine_config().cache_config.cache_dtype == "float32"
    with pytest.raises(InvalidInputError, match="kv_cache_dtype must be the model's dtype"):
        resolve_kv_cache_dtype("bfloat16", dense_config.model_config, "triton")
    with pytest.raises(InvalidInputError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16"):
        EngineArgs(model=str(tiny_llama), kv_cache_dtype="fp8")


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    base = [[rng.randrange(3, 2048) for _ in range(n)] for n in (6, 23, 41, 64)]
    return base + [list(base[2]), base[3][:32] + [rng.randrange(3, 2048) for _ in range(9)]]


def _greedy(model, **overrides) -> list[list[int]]:
    kwargs = dict(executor="uni", max_model_len=128, quantization="int4") | overrides
    with LLM(str(model), **kwargs) as llm:
        assert llm.config.cache_config.cache_dtype == "float16"
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def packed_baseline(tiny_llama):
    return _greedy(tiny_llama)


@pytest.mark.skipif(not cpu_build.available(), reason="needs stepahead's CPU kernels")
@pytest.mark.parametrize("overrides", [
    dict(async_scheduling=False), dict(max_num_batched_tokens=8), dict(enable_prefix_caching=False),
    dict(num_kv_blocks=10)], ids=["sync", "chunked", "no_prefix_cache", "preempt"])
def test_a_float16_cache_under_packed_weights_keeps_the_engines_equivalences(tiny_llama, packed_baseline, overrides):
    assert _greedy(tiny_llama, **overrides) == packed_baseline
