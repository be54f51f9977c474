"""ModelRunner driven by the real Scheduler / AsyncScheduler (one step ahead, placeholders), with
chunked prefill, prefix caching, preemption from a small KV pool and a drop-mode reset: the delivered
tokens equal transformers' greedy output, and seeded sampling is the same sync and async."""

from __future__ import annotations

import random

import pytest

from stepahead.worker.model_runner import ModelRunner
from tests.core.harness import Harness
from tests.tiny_models import hf_greedy
from tests.worker.driver import make_config

MAX_NEW = 10


def _prompts():
    rng = random.Random(1)
    shared = [rng.randrange(3, 2000) for _ in range(24)]
    tails = [[rng.randrange(3, 2000) for _ in range(n)] for n in (3, 14, 0, 21, 9, 30)]
    return [shared + t if i % 2 == 0 else t + shared for i, t in enumerate(tails)]


@pytest.fixture(scope="module")
def setup(tiny_model_factory):
    folder = tiny_model_factory("llama")
    return folder, hf_greedy(folder, _prompts(), MAX_NEW)


def _harness(folder, is_async, num_blocks, block_size=8, budget=40, **params):
    h = Harness(is_async=is_async, block_size=block_size, num_blocks=num_blocks, budget=budget, max_num_seqs=8,
                max_model_len=64)
    h.worker = ModelRunner(make_config(folder, block_size=block_size, num_blocks=num_blocks, max_model_len=64))
    h.prefix_hits = []
    execute = h.worker.execute_model

    def spy(so):  # record admissions with a prefix-cache hit
        h.prefix_hits += [nr.req_id for nr in so.scheduled_new_reqs if nr.num_computed_tokens > 0]
        return execute(so)

    h.worker.execute_model = spy
    for i, p in enumerate(_prompts()):
        h.add(f"r{i}", p, max_tokens=MAX_NEW, ignore_eos=True, **params)
    return h


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("num_blocks", [64, 16], ids=["roomy", "preempting"])
def test_scheduler_driven_greedy_matches(setup, is_async, num_blocks):
    folder, ref = setup
    h = _harness(folder, is_async, num_blocks, temperature=0.0)
    h.run()
    assert [h.delivered[f"r{i}"] for i in range(len(ref))] == ref
    if num_blocks == 16:
        assert h.sched.num_preemptions > 0
    else:
        assert h.prefix_hits


def test_reset_prefix_cache_drop_mode_resumes_identically(setup):
    folder, ref = setup
    h = _harness(folder, True, 64, temperature=0.0)
    for _ in range(9):
        h.step()
    assert h.sched.reset_prefix_cache(reset_running_requests=True)
    h.run()
    assert [h.delivered[f"r{i}"] for i in range(len(ref))] == ref


def test_seeded_sampling_async_equals_sync(setup):
    folder, _ = setup
    runs = []
    for is_async in (True, False):
        h = _harness(folder, is_async, 16, temperature=0.9, top_p=0.95, seed=11)
        h.run()
        runs.append(dict(h.delivered))
    assert runs[0] == runs[1]
    assert len({tuple(v) for v in runs[0].values()}) > 1
