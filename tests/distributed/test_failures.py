"""A rank that dies fails the requests in flight within seconds and leaves no process; sizes that do not
split the model fail at start with the numbers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from stepahead import LLM, SamplingParams
from stepahead.engine.arg_utils import EngineArgs
from stepahead.executor.abstract import WorkerError
from stepahead.executor.mp import MultiprocExecutor
from tests.distributed.conftest import MAX_MODEL_LEN, prompts
from tests.distributed.procs import wait_gone


@pytest.mark.parametrize("victim", [0, 1])
def test_killed_rank_fails_requests_and_stops_the_others(tiny_llama, victim):
    """Rank 1 (the pipeline's last stage, the sampler) or rank 0 (first stage) is killed mid-generation."""
    llm = LLM(str(tiny_llama), max_model_len=MAX_MODEL_LEN, pipeline_parallel_size=2)
    try:
        pids = llm._executor.worker_pids
        stream = llm.generate_stream(prompts()[1], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
        next(stream)
        os.kill(pids[victim], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(Exception, match=rf"worker rank {victim} \(pid \d+\) died unexpectedly"):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 10
        assert wait_gone(pids, 10) == []
    finally:
        llm.shutdown()
    assert wait_gone(pids, 10) == []


def test_rank_that_fails_to_load_reports_its_error(tiny_model_factory, tmp_path):
    """Each rank sends its traceback, then exits: the error is read before the exit is noticed."""
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(tiny_model_factory("llama"), folder)
    config = EngineArgs(model=str(folder), max_model_len=MAX_MODEL_LEN, pipeline_parallel_size=2).create_engine_config()
    (folder / "model.safetensors").write_bytes(b"not weights")  # breaks after the config was read
    with pytest.raises(WorkerError, match=r"worker rank \d failed to start: loading the model failed"):
        MultiprocExecutor(config)


@pytest.mark.parametrize("overrides,message", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not divide num_attention_heads=4"),
    (dict(pipeline_parallel_size=3), "pipeline_parallel_size=3 exceeds num_hidden_layers=2"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "tensor_parallel_size=2"),
])
def test_sizes_that_do_not_split_the_model(tiny_llama, overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(tiny_llama), max_model_len=MAX_MODEL_LEN, **overrides).create_engine_config()


def test_more_ranks_than_cuda_devices(tiny_llama, monkeypatch):
    """Checked at start, before any process: NCCL puts one rank on each device. (The device count is
    set here; this machine has no GPU.)"""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 x pipeline_parallel_size=1 needs 2 CUDA devices, "
                                         r"1 visible"):
        EngineArgs(model=str(tiny_llama), max_model_len=MAX_MODEL_LEN, device="cuda",
                   tensor_parallel_size=2).create_engine_config()
