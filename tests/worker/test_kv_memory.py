"""Sizing the KV pool from device memory: the arithmetic, the profiling step's shapes (run here on CPU,
where only CUDA measures memory), and the engine adopting the size its worker chose."""

from __future__ import annotations

import dataclasses

import pytest

from stepahead.engine.arg_utils import EngineArgs
from stepahead.engine.core import EngineCore
from stepahead.tools.scripted_worker import ScriptedModel
from stepahead.worker import kv_memory
from stepahead.worker.kv_memory import GiB, MemoryProfile, describe, kv_pool_blocks
from stepahead.worker.model_runner import ModelRunner
from tests.engine.fake_executor import EOS, FakeExecutor, make_engine
from tests.worker.driver import make_config


def test_pool_gets_what_the_budget_leaves():
    profile = MemoryProfile(total_bytes=100 * GiB, used_bytes=10 * GiB, activation_peak_bytes=3 * GiB,
                            graph_pool_bytes=GiB)
    # 0.9 * 100 - 10 - 3 - 1 = 76 GiB of 1 MiB blocks, capped by what max_num_seqs full sequences need.
    assert kv_pool_blocks(profile, 0.9, 2**20, 10**9) == 76 * 1024
    assert kv_pool_blocks(profile, 0.9, 2**20, 5000) == 5000
    assert kv_pool_blocks(profile, 0.1, 2**20, 10**9) == 0  # over budget already: the runner refuses
    text = describe(profile, 0.9, 76 * 1024, 16, 2**20)
    assert "77823 usable blocks of 16 tokens = 1245168 tokens" in text and "activation peak 3.00 GiB" in text


def test_cuda_without_a_pool_size_leaves_sizing_to_the_worker(tiny_llama, monkeypatch):
    monkeypatch.setattr(EngineArgs, "resolve_device", lambda self: "cuda")
    args = dict(model=str(tiny_llama), max_model_len=64, max_num_seqs=8, block_size=16, load_format="dummy")
    cache = EngineArgs(**args, gpu_memory_utilization=0.8).create_engine_config().cache_config
    assert cache.gpu_memory_utilization == 0.8 and cache.num_blocks == 8 * 4 + 1  # the upper bound
    for explicit in (dict(num_kv_blocks=20), dict(kv_cache_memory_bytes=2**20)):
        assert EngineArgs(**args, **explicit).create_engine_config().cache_config.gpu_memory_utilization is None
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(**args, gpu_memory_utilization=1.5)


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_profiling_steps_run_for_each_backend(tiny_llama, backend):
    runner = ModelRunner(make_config(tiny_llama, attention_backend=backend, max_num_batched_tokens=96))
    kv_memory.dummy_step(runner, 96, 1)  # the largest prefill
    kv_memory.dummy_step(runner, 96, 3)  # ... in rows of at most max_model_len tokens
    kv_memory.dummy_step(runner, 64, 64)  # the largest decode step (the graphs' shape)


def test_engine_adopts_the_pool_size_its_worker_chose():
    core, _ = make_engine(num_blocks=128)
    executor = FakeExecutor(ScriptedModel(eos_token_id=EOS), block_size=4, num_blocks=40)
    executor.num_kv_blocks = 40
    adopted = EngineCore(core.config, executor)
    assert adopted.config.cache_config.num_blocks == 40
    assert adopted.scheduler.kv_cache_manager.num_usable_blocks == 39
    assert dataclasses.replace(core.config.cache_config, num_blocks=40) == adopted.config.cache_config
    core.executor.shutdown()
    executor.shutdown()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pool_sized_from_memory_serves_requests(tiny_llama):
    from stepahead import LLM, SamplingParams

    with LLM(str(tiny_llama), device="cuda", max_model_len=128, gpu_memory_utilization=0.5) as llm:
        cache = llm.config.cache_config
        assert cache.gpu_memory_utilization == 0.5 and cache.num_blocks == llm.stats().num_total_blocks + 1
        (out,) = llm.generate({"prompt_token_ids": list(range(5, 40))},
                              SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 8
