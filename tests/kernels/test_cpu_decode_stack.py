"""DecodeStack (kernels/cpu_decode_stack.py): a packed model's decode-only step in one C++ call is
bitwise the step its Python layers compute, KV writes included; other steps and models keep the layers."""

from __future__ import annotations

import pytest
import torch

from stepahead.attention.paged_cache import PagedKVCache
from stepahead.attention.rows import BatchRow
from stepahead.attention.sdpa import SdpaBackend
from stepahead.kernels import cpu_build
from stepahead.models.loading.loader import load_model, load_model_config
from stepahead.worker.staging import StagingBuffer

pytestmark = pytest.mark.skipif(not cpu_build.machine_can_build(), reason="needs an AVX2 CPU and a C++ compiler")

BLOCK, MAX_BLOCKS = 16, 32


def _step(model, cache: PagedKVCache, rows: list[BatchRow], ids: torch.Tensor) -> torch.Tensor:
    """One forward pass over `rows` (single-token rows first) with the runner's staging and metadata."""
    staging = StagingBuffer(4096, torch.device("cpu"))
    backend = SdpaBackend(BLOCK, MAX_BLOCKS, torch.arange(MAX_BLOCKS * BLOCK + 64), decode_kernel=True)
    staged = backend.stage(rows, sum(row.num_new_tokens == 1 for row in rows), staging)
    slots, offset = staging.alloc(len(ids))
    positions = []
    for row in rows:
        for i in range(row.num_new_tokens):
            pos = row.num_computed_tokens + i
            slots[row.start + i] = row.block_ids[pos // BLOCK] * BLOCK + pos % BLOCK
            positions.append(pos)
    meta = backend.finish(staged, staging.view(offset, len(ids)), staging)
    return model(ids, torch.tensor(positions), cache, meta)


def _layers_step(model, cache: PagedKVCache, rows: list[BatchRow], ids: torch.Tensor) -> torch.Tensor:
    """_step through the model's Python layers, DecodeStack off."""
    stack, model.decode_stack = model.decode_stack, None
    try:
        return _step(model, cache, rows, ids)
    finally:
        model.decode_stack = stack


def _random_cache(model, seed: int, dtype: torch.dtype = torch.float32, blocks: int = 40) -> PagedKVCache:
    a = model.args
    cache = PagedKVCache(a.num_layers, blocks, BLOCK, a.num_kv_heads, a.head_dim, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=gen))
    return cache


def _clone(cache: PagedKVCache) -> PagedKVCache:
    copy = PagedKVCache(len(cache.k), cache.k[0].shape[1], BLOCK, cache.num_kv_heads, cache.head_dim,
                        cache.k[0].dtype, "cpu")
    for dst, src in zip(copy.k + copy.v, cache.k + cache.v, strict=True):
        dst.copy_(src)
    return copy


@pytest.fixture
def threads(request):
    """torch's thread count for the test (DecodeStack runs its step on a team of that many threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# qwen2: biased q/k/v projections; 3 threads on this 2-core machine: more threads than cores; 16-bit
# caches: the K/V written rounded as torch rounds them
@pytest.mark.parametrize("arch,threads,cache_dtype", [
    ("llama", 2, torch.float32), ("qwen2", 2, torch.float32), ("llama", 1, torch.float32),
    ("llama", 3, torch.float32), ("llama", 2, torch.float16), ("qwen2", 2, torch.bfloat16)],
    indirect=["threads"])
def test_a_decode_step_in_one_call_is_the_layers_step_bitwise(tiny_model_factory, arch, threads, cache_dtype):
    model = load_model(load_model_config(str(tiny_model_factory(arch)), "cpu", quantization="int4"), "cpu")
    assert model.cpu_kernels and model.decode_stack is not None
    # Three decode rows of 5, 17 and 70 cached tokens on scattered blocks.
    rows = [BatchRow(0, 1, 5, [7]), BatchRow(1, 1, 17, [3, 12]), BatchRow(2, 1, 70, [20, 2, 9, 31, 14])]
    ids = torch.tensor([11, 22, 33])
    cache = _random_cache(model, 0, cache_dtype)
    in_one_call, by_layers = _clone(cache), _clone(cache)
    fast = _step(model, in_one_call, rows, ids)
    slow = _layers_step(model, by_layers, rows, ids)
    assert torch.equal(fast, slow)
    for a, b in zip(in_one_call.k + in_one_call.v, by_layers.k + by_layers.v, strict=True):
        assert torch.equal(a, b)  # the new tokens' K/V written at the same slots, the same values
    # A row's result does not depend on the batch: row 1 alone is row 1 of the batch.
    alone = _step(model, _clone(cache), [BatchRow(0, 1, 17, [3, 12])], ids[1:2])
    assert torch.equal(alone[0], fast[1])


def test_a_step_of_more_rows_than_a_gemm_panel_is_the_layers_step_bitwise(tiny_model_factory):
    """The packed GEMM takes 84 rows of 1,536 inputs per panel (kernels/packed_gemm.cpp): 90 decode rows
    put the down projection's last rows in a second panel, which DecodeStack adds to the residual stream
    in place and the layers add after the call."""
    model = load_model(load_model_config(str(tiny_model_factory("llama", intermediate_size=1536)), "cpu",
                                         quantization="int4"), "cpu")
    assert model.decode_stack is not None
    rows = [BatchRow(i, 1, 3 + i % 5, [i + 1]) for i in range(90)]
    ids = torch.arange(90) % 50 + 1
    cache = _random_cache(model, 3, blocks=100)
    fast = _step(model, _clone(cache), rows, ids)
    slow = _layers_step(model, _clone(cache), rows, ids)
    assert torch.equal(fast, slow)
    alone = _step(model, _clone(cache), [BatchRow(0, 1, 3 + 89 % 5, [90])], ids[89:])  # the last row alone
    assert torch.equal(alone[0], fast[89])


def test_steps_with_a_prefill_and_unsupported_models_keep_the_layers(tiny_model_factory):
    qwen3 = load_model(load_model_config(str(tiny_model_factory("qwen3")), "cpu", quantization="int4"), "cpu")
    assert qwen3.cpu_kernels and qwen3.decode_stack is None  # per-head q/k norms: the Python layers
    dense = load_model(load_model_config(str(tiny_model_factory("llama")), "cpu", quantization="none"), "cpu")
    assert dense.decode_stack is None
    model = load_model(load_model_config(str(tiny_model_factory("llama")), "cpu", quantization="int4"), "cpu")
    rows = [BatchRow(0, 1, 5, [7]), BatchRow(1, 4, 0, [4])]  # a decode row and a 4-token prefill
    ids = torch.tensor([11, 1, 2, 3, 4])
    cache = _random_cache(model, 1)
    mixed = _step(model, _clone(cache), rows, ids)
    by_layers = _layers_step(model, _clone(cache), rows, ids)
    assert torch.equal(mixed, by_layers)
    # and the decode row's result equals its decode-only step's, which runs in one call
    assert torch.equal(_step(model, _clone(cache), rows[:1], ids[:1])[0], mixed[0])


def test_a_value_beyond_a_float16_cache_fails_the_step_in_one_call_too(tiny_model_factory):
    model = load_model(load_model_config(str(tiny_model_factory("llama")), "cpu", quantization="int4"), "cpu")
    with torch.no_grad():
        model.layers[0].input_layernorm.weight.mul_(1e6)  # K and V far beyond float16's 65504
    rows = [BatchRow(0, 1, 5, [7])]
    for stack in (model.decode_stack, None):
        model.decode_stack = stack
        with pytest.raises(RuntimeError, match="beyond float16's range"):
            _step(model, _random_cache(model, 2, torch.float16), rows, torch.tensor([11]))
