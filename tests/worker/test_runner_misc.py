"""ModelRunner odds and ends: empty steps, traces and busy time, bf16, finished-request cleanup."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from stepahead.core.sched_output import SchedulerOutput
from stepahead.engine.arg_utils import EngineArgs
from stepahead.models.loading.loader import load_model_config
from stepahead.sampling_params import SamplingParams
from stepahead.worker.model_runner import ModelRunner
from tests.worker.driver import MiniSched, make_config

ASYNC_OUTPUT = pytest.mark.parametrize("async_output", [False, True], ids=["sync-output", "async-output"])


@ASYNC_OUTPUT
def test_empty_step_applies_finished_and_returns_empty(tiny_llama, async_output):
    runner = ModelRunner(make_config(tiny_llama, async_output=async_output))
    sched = MiniSched(runner, 16)
    sched.add("a", list(range(10, 30)), 1)
    sched.run()
    assert "a" in runner.requests
    out = runner.execute_model(SchedulerOutput.make_empty({"a"}))
    assert out.req_ids == [] and out.sampled_token_ids == []
    assert "a" not in runner.requests


@ASYNC_OUTPUT
def test_trace_events_and_busy_time(tiny_llama, async_output):
    cfg = make_config(tiny_llama, async_output=async_output)
    cfg = dataclasses.replace(cfg, trace=True)
    runner = ModelRunner(cfg)
    sched = MiniSched(runner, 16)
    sched.add("a", list(range(10, 30)), 2)
    sched.add("b", list(range(40, 45)), 2)
    out = sched.step()
    names = [e.name for e in out.trace_events]
    assert names == ["prepare_inputs", "forward", "sample"]
    assert all(e.lane == "worker" and e.end >= e.start for e in out.trace_events)
    assert out.trace_events[0].args == {"step": 0, "num_reqs": 2, "num_tokens": 25}
    assert out.busy_s > 0


def test_bfloat16_runs_and_mostly_agrees(tiny_llama):
    prompt = list(range(100, 140))
    outs = {}
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner(make_config(tiny_llama, dtype=dtype))
        assert runner.kv_cache.k[0].dtype == getattr(torch, dtype)
        sched = MiniSched(runner, 16)
        sched.add("a", prompt, 4, SamplingParams(temperature=0.0))
        outs[dtype] = sched.run()["a"]
    assert outs["bfloat16"][0] == outs["float32"][0]


def test_mistral_sliding_window_keeps_the_full_context(tiny_model_factory, tmp_path):
    folder = shutil.copytree(tiny_model_factory("mistral"), tmp_path / "mistral-sw")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["sliding_window"] = 64
    (folder / "config.json").write_text(json.dumps(cfg))
    config = load_model_config(str(folder), "cpu")
    assert config.max_model_len == cfg["max_position_embeddings"]
    assert config.sliding_windows == (64, 64)
    # Every layer windowed: the window reaches the scheduler's KV cache manager, which returns the
    # blocks that fall out of it.
    engine_config = EngineArgs(model=str(folder), num_kv_blocks=40).create_engine_config()
    assert engine_config.cache_config.sliding_window == 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_float32_greedy_matches_transformers(tiny_llama):
    from tests.tiny_models import hf_greedy

    prompts = [list(range(100, 140)), list(range(7, 12)), list(range(300, 333))]
    runner = ModelRunner(make_config(tiny_llama, device="cuda", dtype="float32", max_num_seqs=len(prompts)))
    sched = MiniSched(runner, 16, chunk=16)
    for i, p in enumerate(prompts):
        sched.add(f"r{i}", p, 6, SamplingParams(temperature=0.0))
    out = sched.run()
    assert [out[f"r{i}"] for i in range(3)] == hf_greedy(tiny_llama, prompts, 6)
