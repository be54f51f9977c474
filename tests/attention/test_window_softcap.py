"""Sliding-window and soft-capped attention on the CPU paths (SDPA and stepahead's kernel) against a
float64 reference over the cache's values, through the real staging and metadata path; and a layer's
output holds nothing of the blocks wholly before its window (another request may hold them by then)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stepahead.attention.paged_cache import PagedKVCache
from stepahead.attention.rows import BatchRow
from stepahead.kernels import cpu_build
from tests.attention.staged import attend_staged

HEADS, KV_HEADS = 6, 2
needs_kernels = pytest.mark.skipif(not cpu_build.machine_can_build(), reason="needs an AVX2 CPU and a C++ compiler")
PATHS = [pytest.param(False, id="sdpa"), pytest.param(True, id="kernel", marks=needs_kernels)]


def _reference(q, cache, rows, block_size, window, softcap, scale):
    """float64 attention of every new token over the keys in its window, read from the cache."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = HEADS // KV_HEADS
    for row in rows:
        total = row.num_computed_tokens + row.num_new_tokens
        pos = torch.arange(total)
        blocks = torch.tensor(row.block_ids)[pos // block_size]
        keys = cache.k[0][:, blocks, pos % block_size].double().repeat_interleave(group, 0)  # [heads, total, hd]
        values = cache.v[0][:, blocks, pos % block_size].double().repeat_interleave(group, 0)
        for i in range(row.num_new_tokens):
            p = row.num_computed_tokens + i
            lo = 0 if window is None else max(0, p - window + 1)
            scores = (q[row.start + i].double().unsqueeze(1) @ keys[:, lo:p + 1].transpose(1, 2)).squeeze(1) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out[row.start + i] = (torch.softmax(scores, -1).unsqueeze(1) @ values[:, lo:p + 1]).squeeze(1)
    return out


def _batch(block_size, head_dim, seed):
    """Decode rows of several lengths, a prompt after a cached prefix, two fresh prompts of one length
    (one SDPA call) and a longer fresh one, each request on scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, 0), (1, 6), (1, 40), (1, 77), (9, 31), (12, 0), (12, 0), (30, 0)]  # (new, cached)
    need = [-(-(n + c) // block_size) for n, c in shapes]
    order = (torch.randperm(sum(need) + 4, generator=g) + 1).tolist()
    rows, start = [], 0
    for (n, c), b in zip(shapes, need, strict=True):
        rows.append(BatchRow(start, n, c, order[:b]))
        order, start = order[b:], start + n
    cache = PagedKVCache(1, sum(need) + 6, block_size, KV_HEADS, head_dim, torch.float32, "cpu")
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    qkv = torch.randn(start, HEADS + 2 * KV_HEADS, head_dim, generator=g) * 2
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    return rows, cache, q, k, v


@pytest.mark.parametrize("decode_kernel", PATHS)
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (8, 32), (5, 12)])
@pytest.mark.parametrize("window,softcap", [(7, None), (16, None), (1, None), (None, 3.0), (10, 2.0), (100, None)])
def test_window_and_softcap_match_float64(decode_kernel, block_size, head_dim, window, softcap):
    rows, cache, q, k, v = _batch(block_size, head_dim, seed=block_size * 100 + head_dim)
    scale = head_dim ** -0.5
    out = attend_staged(q, k, v, cache, rows, decode_kernel, block_size, scale, window, softcap)
    torch.testing.assert_close(out.double(), _reference(q, cache, rows, block_size, window, softcap, scale),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("decode_kernel", PATHS)
@pytest.mark.parametrize("block_size", [8, 16])
def test_blocks_before_the_window_are_not_in_the_output(decode_kernel, block_size):
    """NaN in every block that holds only keys before all of a request's windows (blocks the engine
    may hand to another request): each output is bitwise unchanged, neither path reads them."""
    rows, cache, q, k, v = _batch(block_size, 64, seed=block_size)
    window = 10
    attend_staged(q, k, v, cache, rows, decode_kernel, block_size, 0.125, window)  # the new K/V in the cache
    before = attend_staged(q, k, v, cache, rows, decode_kernel, block_size, 0.125, window)
    for row in rows:
        first_key = max(0, row.num_computed_tokens - window + 1)
        for b in row.block_ids[:first_key // block_size]:
            cache.k[0][:, b].fill_(float("nan"))
            cache.v[0][:, b].fill_(float("nan"))
    # the new tokens' K/V go to the cache again, into blocks inside the window (unchanged)
    after = attend_staged(q, k, v, cache, rows, decode_kernel, block_size, 0.125, window)
    assert torch.equal(before, after)


@pytest.mark.parametrize("decode_kernel", PATHS)
def test_a_windowed_rows_attention_does_not_depend_on_its_batch(decode_kernel):
    """Under a window each row still reads what it reads alone (SDPA: a table width fixed by its own
    padded width and the window), so its output bits are the same in any batch."""
    rows, cache, q, k, v = _batch(16, 64, seed=7)
    together = attend_staged(q, k, v, cache, rows, decode_kernel, 16, 0.125, 20, 4.0)
    for row in rows:
        span = slice(row.start, row.start + row.num_new_tokens)
        alone = attend_staged(q[span], k[span], v[span], cache,
                              [dataclasses.replace(row, start=0)], decode_kernel, 16, 0.125, 20, 4.0)
        assert torch.equal(alone, together[span]), row
