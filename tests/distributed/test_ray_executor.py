"""The Ray executor on a local Ray cluster started by the test: TP=2 gives the single-rank tokens."""

from __future__ import annotations

import pytest

from stepahead import LLM
from tests.distributed.conftest import GREEDY, MAX_MODEL_LEN, SEEDED, token_ids
from tests.distributed.procs import wait_gone

pytest.importorskip("ray")


def test_ray_tensor_parallel_equals_one_rank(local_ray_cluster, tiny_llama, single_rank_tokens):
    greedy, seeded = single_rank_tokens["llama"]
    with LLM(str(tiny_llama), max_model_len=MAX_MODEL_LEN, tensor_parallel_size=2,
             distributed_executor_backend="ray") as llm:
        assert llm.config.executor == "ray"
        pids = llm._executor.worker_pids
        assert token_ids(llm, GREEDY) == greedy
        assert token_ids(llm, SEEDED) == seeded
    assert wait_gone(pids, 20) == []
