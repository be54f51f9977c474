"""ModelRunner greedy tokens equal transformers float32, across families, block sizes, chunking,
prefix-cache hits and preemption/resume; the stateful cases also with async outputs (the CUDA default)."""

from __future__ import annotations

import random

import pytest

from stepahead.worker.model_runner import ModelRunner
from tests.tiny_models import build_tiny_model, hf_greedy
from tests.worker.driver import MiniSched, make_config

MAX_NEW = 8


def _prompts(n=4, lens=(5, 17, 33, 40), seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(lens[i % len(lens)])] for i in range(n)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(arch, **overrides):
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            folder = build_tiny_model(tmp_path_factory.mktemp(f"ref-{arch}"), arch, **overrides)
            cache[key] = (folder, hf_greedy(folder, _prompts(), MAX_NEW))
        return cache[key]

    return get


ASYNC_OUTPUT = pytest.mark.parametrize("async_output", [False, True], ids=["sync-output", "async-output"])


def _run(folder, block_size, chunk=10**9, prompts=None, async_output=False):
    runner = ModelRunner(make_config(folder, block_size=block_size, async_output=async_output))
    sched = MiniSched(runner, block_size, chunk=chunk)
    for i, p in enumerate(prompts or _prompts()):
        sched.add(f"r{i}", p, MAX_NEW)
    return runner, sched, sched.run()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_greedy_matches_transformers(references, arch, block_size):
    folder, ref = references(arch)
    _, _, out = _run(folder, block_size)
    assert [out[f"r{i}"] for i in range(len(ref))] == ref


@ASYNC_OUTPUT
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_matches(references, arch, async_output):
    folder, ref = references(arch)
    _, _, out = _run(folder, 16, chunk=7, async_output=async_output)
    assert [out[f"r{i}"] for i in range(len(ref))] == ref


@pytest.mark.parametrize("overrides", [{"tie_word_embeddings": True},
                                       {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 16}},
                                       {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}],
                         ids=["tied", "llama3-rope", "linear-rope"])
def test_variants_match(references, overrides):
    folder, ref = references("llama", **overrides)
    _, _, out = _run(folder, 16)
    assert [out[f"r{i}"] for i in range(len(ref))] == ref


@ASYNC_OUTPUT
def test_prefix_cache_hit_gives_same_tokens(references, async_output):
    folder, ref = references("llama")
    prompt = _prompts()[3]  # 40 tokens: two full blocks of 16
    runner = ModelRunner(make_config(folder, block_size=16, async_output=async_output))
    sched = MiniSched(runner, 16)
    first = sched.add("a", prompt, MAX_NEW)
    sched.run()
    # Second request with the same prompt claims the first one's two full blocks as a cache hit.
    sched.add("b", prompt, MAX_NEW, prefix_blocks=first.blocks[:2])
    out = sched.run()
    assert out["a"] == ref[3] and out["b"] == ref[3]


@ASYNC_OUTPUT
def test_preempted_request_resumes_identically(references, async_output):
    folder, ref = references("llama")
    runner = ModelRunner(make_config(folder, block_size=16, async_output=async_output))
    sched = MiniSched(runner, 16, chunk=24)
    for i, p in enumerate(_prompts()):
        sched.add(f"r{i}", p, MAX_NEW)
    for _ in range(5):
        sched.step()
    sched.preempt("r1")
    sched.preempt("r3")
    out = sched.run()
    assert [out[f"r{i}"] for i in range(4)] == ref


@ASYNC_OUTPUT
def test_partial_prefill_returns_empty_and_unscheduled_keep_state(references, async_output):
    folder, ref = references("llama")
    runner = ModelRunner(make_config(folder, block_size=16, async_output=async_output))
    sched = MiniSched(runner, 16, chunk=16)
    prompts = _prompts()
    sched.add("r0", prompts[0], MAX_NEW)
    sched.add("r3", prompts[3], MAX_NEW)
    out = sched.step()
    assert out.sampled_token_ids[out.req_ids.index("r3")] == []  # 16 of 40 prompt tokens
    assert len(out.sampled_token_ids[out.req_ids.index("r0")]) == 1
    sched.step(only={"r3"})  # r0 sits out a step: its state must survive
    res = sched.run()
    assert res["r0"] == ref[0] and res["r3"] == ref[3]


def test_decode_rows_are_padded_by_their_own_length():
    from stepahead.attention.sdpa import decode_groups, padded_blocks

    assert [padded_blocks(n) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    assert all(n <= padded_blocks(n) <= 1.5 * n for n in range(1, 500))
    assert decode_groups([1] * 8 + [10] * 4, 64) == [(0, 8, 1), (8, 12, 12)]
    assert decode_groups([1, 1, 10], 64) == [(0, 2, 1), (2, 3, 12)]  # a row's width never depends on the others
    assert decode_groups([5, 6, 7, 8], 64) == [(0, 2, 6), (2, 4, 8)]
    assert decode_groups([9, 10], 10) == [(0, 2, 10)]  # capped at a sequence's most blocks


@pytest.mark.parametrize("decode_kernel", [False, True])
def test_mixed_length_decode_groups_match(tiny_model_factory, decode_kernel):
    folder = tiny_model_factory("llama")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in [4, 6, 3, 9, 5, 7, 4, 8, 150, 170, 140, 200]]
    ref = hf_greedy(folder, prompts, 6)
    runner = ModelRunner(make_config(folder, block_size=16))
    if decode_kernel and not runner.model.cpu_kernels:
        pytest.skip("stepahead's CPU kernels do not build here")
    runner.attention_backend.decode_kernel = decode_kernel  # float32 on CPU runs the kernel where it builds
    sched = MiniSched(runner, 16)
    for i, p in enumerate(prompts):
        sched.add(f"r{i}", p, 6)
    sched.step()  # all prefills
    seen = []
    orig = runner.model.forward

    def spy(input_ids, positions, kv_cache, meta, **kw):
        seen.append(len(meta.decode_groups))
        return orig(input_ids, positions, kv_cache, meta, **kw)

    runner.model.forward = spy
    out = sched.run()
    assert [out[f"r{i}"] for i in range(len(prompts))] == ref
    # SDPA: padded widths 1 (the short prompts), 12 and 16 blocks; the kernel: every decode row in one call
    assert max(seen) == (1 if decode_kernel else 3)
