"""ModelRunner with the Triton attention backend (the CUDA path; here through Triton's interpreter):
greedy tokens equal transformers float32 across families, block sizes, chunking, prefix-cache hits and
preemption, and a decode step padded to a captured batch size equals the unpadded step. On CUDA: float32
greedy ids equal transformers, and bf16 graph replay equals the same padded pass run eagerly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stepahead.worker.cuda_graphs import DecodeBatch, DecodeGraphs, capture_sizes
from stepahead.worker.model_runner import ModelRunner
from tests.tiny_models import build_tiny_model, hf_greedy
from tests.worker.driver import MiniSched, make_config

pytest.importorskip("triton")

MAX_NEW = 6
PROMPTS = [[5 + (7 * i + 3 * j) % 1900 for j in range(n)] for i, n in enumerate((5, 17, 33, 40))]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            folder = build_tiny_model(tmp_path_factory.mktemp(f"triton-{arch}"), arch)
            cache[arch] = (folder, hf_greedy(folder, PROMPTS, MAX_NEW))
        return cache[arch]

    return get


def _runner(folder, block_size, async_output=False):
    return ModelRunner(make_config(folder, block_size=block_size, num_blocks=1024, attention_backend="triton",
                                   async_output=async_output))


# One case with async outputs, as the runner runs on CUDA by default.
@pytest.mark.parametrize("arch,block_size,async_output", [("llama", 16, False), ("qwen3", 1, False),
                                                          ("mistral", 32, True)])
def test_greedy_matches_transformers(references, arch, block_size, async_output):
    folder, ref = references(arch)
    runner = _runner(folder, block_size, async_output)
    assert runner.async_output == async_output
    assert runner.attention_backend.name == "triton"
    sched = MiniSched(runner, block_size)
    for i, p in enumerate(PROMPTS):
        sched.add(f"r{i}", p, MAX_NEW)
    out = sched.run()
    assert [out[f"r{i}"] for i in range(len(ref))] == ref


def test_chunked_prefill_prefix_hit_and_preemption(references):
    folder, ref = references("llama")
    sched = MiniSched(_runner(folder, 16), 16, chunk=7)
    for i, p in enumerate(PROMPTS):
        sched.add(f"r{i}", p, MAX_NEW)
    for _ in range(4):
        sched.step()
    sched.preempt("r1")
    out = sched.run()
    assert [out[f"r{i}"] for i in range(4)] == ref
    # The same prompt again, its first two blocks taken from r3 as a prefix-cache hit.
    sched.add("again", PROMPTS[3], MAX_NEW, prefix_blocks=sched.reqs["r3"].blocks[:2])
    assert sched.run()["again"] == ref[3]


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    sizes = capture_sizes(300)
    assert sizes[:5] == [1, 2, 4, 8, 16] and 256 in sizes and 272 in sizes and sizes[-1] == 300


def test_padded_decode_equals_unpadded(tiny_llama):
    """The forward pass a captured graph replays, run eagerly: padding rows (context 0, slot -1) change
    neither the real rows' hidden states nor the KV cache."""
    runner = _runner(tiny_llama, 16)
    sched = MiniSched(runner, 16)
    for i, p in enumerate(PROMPTS[:3]):
        sched.add(f"r{i}", p, 4)
    sched.step()  # the prefills: every request now decodes
    sched.step()
    decode_step = sched.build()
    runner._update_states(decode_step)
    inputs = runner._prepare_inputs(decode_step)
    assert inputs.max_query_len == 1
    kv_before = [t.clone() for t in runner.kv_cache.k]
    eager = runner.model(inputs.input_ids, inputs.positions, runner.kv_cache, inputs.attn_metadata)
    kv_eager = [t.clone() for t in runner.kv_cache.k]
    graphs = DecodeGraphs(runner.model, runner.kv_cache, max_num_seqs=8, max_blocks_per_seq=8,
                          device=runner.device)
    for size in (3, 4, 8):
        for layer, saved in zip(runner.kv_cache.k, kv_before, strict=True):
            layer.copy_(saved)
        padded = graphs.run(DecodeBatch(inputs.input_ids, inputs.positions, inputs.attn_metadata), size)
        # Same math; the matmuls see more rows, which may change their float summation order.
        torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
        for layer, expected in zip(runner.kv_cache.k, kv_eager, strict=True):
            torch.testing.assert_close(layer, expected, rtol=1e-5, atol=1e-5)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_cuda_greedy_matches_transformers(references, arch, enforce_eager):
    """float32, as the reference: the fp32 kernels use full-precision dots (bf16 ids drift from fp32's)."""
    folder, ref = references(arch)
    runner = ModelRunner(make_config(folder, device="cuda", dtype="float32", enforce_eager=enforce_eager,
                                     max_num_seqs=len(PROMPTS)))
    assert (runner.decode_graphs is None) == enforce_eager and runner.async_output
    sched = MiniSched(runner, 16)
    for i, p in enumerate(PROMPTS):
        sched.add(f"r{i}", p, MAX_NEW)
    out = sched.run()
    assert [out[f"r{i}"] for i in range(len(ref))] == ref


def _cuda_runs(runner: ModelRunner, batch_sizes: tuple[int, ...]) -> dict[str, list[int]]:
    """Batches of each size, one after another on one runner (ids of a batch of n start with f"{n}-")."""
    sched = MiniSched(runner, 16)
    for n in batch_sizes:
        for i in range(n):
            sched.add(f"{n}-{i}", PROMPTS[i % len(PROMPTS)][: 3 + i], 5)
        sched.run()
    return {rid: r.outputs for rid, r in sched.reqs.items()}


GRAPH_BATCH_SIZES = (1, 2, 3, 4, 7, 8, 13, 16, 33, 64)


@needs_cuda
def test_cuda_graph_replay_equals_padded_eager_for_every_size(tiny_llama):
    """bf16 batches of every captured size and sizes between them: a graph replay gives the tokens of the
    same padded forward pass run eagerly (the padded size sets the key splits and the matmul rows, so
    only the same size can be asked to agree exactly)."""
    config = make_config(tiny_llama, device="cuda", num_blocks=1024)
    graphed = ModelRunner(config)
    assert graphed.decode_graphs is not None and graphed.dtype == torch.bfloat16
    padded_eager = ModelRunner(dataclasses.replace(config, enforce_eager=True))
    graphs = graphed.decode_graphs
    # The same buffers and sizes, never captured: DecodeGraphs.run runs the padded forward eagerly.
    padded_eager.decode_graphs = DecodeGraphs(padded_eager.model, padded_eager.kv_cache, graphs.sizes[-1],
                                              graphs.block_table.shape[1], padded_eager.device)
    assert _cuda_runs(graphed, GRAPH_BATCH_SIZES) == _cuda_runs(padded_eager, GRAPH_BATCH_SIZES)


@needs_cuda
def test_cuda_async_outputs_equal_sync_outputs(tiny_llama):
    """bf16, eager: async outputs change when the host reads the ids, never the ids."""
    runs = []
    for async_output in (True, False):
        runner = ModelRunner(make_config(tiny_llama, device="cuda", enforce_eager=True, async_output=async_output))
        assert runner.async_output == async_output
        runs.append(_cuda_runs(runner, (4, 13)))
    assert runs[0] == runs[1]


def test_backend_resolution(monkeypatch):
    from stepahead.engine.arg_utils import resolve_attention_backend
    from stepahead.validation import InvalidInputError

    assert resolve_attention_backend("auto", "cuda") == "triton"
    assert resolve_attention_backend("auto", "cpu") == "sdpa"
    assert resolve_attention_backend("sdpa", "cuda") == "sdpa"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InvalidInputError, match="needs a CUDA device"):
        resolve_attention_backend("triton", "cpu")


@pytest.mark.parametrize("arch,overrides,chunk", [("gemma2", {}, 10**9), ("gemma3", {}, 7),
                                                  ("mistral", {"sliding_window": 9}, 7)])
def test_windowed_and_capped_greedy_matches_transformers(tmp_path, arch, overrides, chunk):
    """Sliding windows shorter than the prompts (and Gemma's logit caps) on the Triton kernels, whole
    prompts and chunks of 7."""
    folder = build_tiny_model(tmp_path / arch, arch, **overrides)
    sched = MiniSched(_runner(folder, 4), 4, chunk=chunk)
    for i, p in enumerate(PROMPTS):
        sched.add(f"r{i}", p, MAX_NEW)
    out = sched.run()
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == hf_greedy(folder, PROMPTS, MAX_NEW)
