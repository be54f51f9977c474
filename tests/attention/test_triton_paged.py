"""Triton paged attention and KV write against a plain torch reference on random paged layouts.

Without CUDA the kernels run on CPU through Triton's interpreter (tiny shapes, small tiles); with CUDA the
same tests run compiled on the GPU, plus larger bf16/fp32 cases and a CUDA-graph replay.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before the kernels are decorated, i.e. before triton_paged is imported.
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from stepahead.attention import sdpa
from stepahead.attention.triton_paged import (
    AttentionTiles,
    attention_launches,
    paged_attention,
    write_kv,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small tiles keep the interpreter fast and give several key steps and query tiles per row.
SMALL = AttentionTiles(block_m=16, block_n=16, num_warps=4, num_stages=1)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pad_row(q_len=1):
    """A CUDA-graph padding row: new tokens but seq_len 0 and an all-zero block table."""
    return (None, q_len)


def make_batch(rows, *, block_size, num_heads, num_kv_heads, head_dim, dtype=torch.float32, device=DEVICE,
               seed=0, spare_tokens=0, block_table_dtype=torch.int32):
    """rows: [(context_len, q_len) or pad_row()] -> random q and cache, each row's blocks scattered.

    The whole cache is random, so a read of a wrong slot shows. spare_tokens adds q tokens after the last
    row (graph padding that belongs to no row)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [0 if c is None else c + n for c, n in rows]
    blocks_per_row = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_row) + 3
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 is the padding block
    block_table = torch.zeros(len(rows), max([1, *blocks_per_row]) + 1, dtype=torch.int64)
    used = 0
    for r, nb in enumerate(blocks_per_row):
        block_table[r, :nb] = perm[used:used + nb]
        used += nb
    q_lens = [n for _c, n in rows]
    q = torch.randn(sum(q_lens) + spare_tokens, num_heads, head_dim, generator=g)
    k_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=g)
    v_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=g)
    query_start_loc = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    return dict(
        q=q.to(device, dtype), k_cache=k_cache.to(device, dtype), v_cache=v_cache.to(device, dtype),
        block_table=block_table.to(device, block_table_dtype),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        max_query_len=max([0, *q_lens]),
    )


def reference(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, window=None, softcap=None):
    """float64 attention of every row's new tokens over its gathered context (the last `window` keys of
    each token's, scores soft-capped when softcap is set); zeros for seq_len-0 rows."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[0]
    block_size = k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    # Converted once: per row, a GPU-sized cache copied to float64 costs more than the attention.
    q, k_cache, v_cache, block_table = q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double(), \
        block_table.cpu().long()
    for r, seq_len in enumerate(lens):
        start, end = qsl[r], qsl[r + 1]
        if seq_len == 0 or end == start:
            continue
        pos = torch.arange(seq_len)
        blocks = block_table[r][pos // block_size]
        k = k_cache[:, blocks, pos % block_size]  # [kv_heads, seq_len, hd]
        v = v_cache[:, blocks, pos % block_size]
        k = k.repeat_interleave(num_heads // num_kv_heads, 0)
        v = v.repeat_interleave(num_heads // num_kv_heads, 0)
        qr = q[start:end].transpose(0, 1)  # [heads, n, hd]
        q_pos = seq_len - (end - start) + torch.arange(end - start)
        scores = (qr @ k.transpose(1, 2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        hidden = pos[None, None, :] > q_pos[None, :, None]
        if window is not None:
            hidden |= pos[None, None, :] <= q_pos[None, :, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def run(batch, tiles=SMALL, out=None, num_kv_splits=None, num_decode_rows=0, window=None, softcap=None):
    scale = batch["q"].shape[-1] ** -0.5
    if out is None:
        out = torch.full_like(batch["q"], float("nan"))
    paged_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_table"], batch["seq_lens"],
                    batch["query_start_loc"], max_query_len=batch["max_query_len"], scale=scale, out=out,
                    tiles=tiles, num_kv_splits=num_kv_splits, num_decode_rows=num_decode_rows, window=window,
                    softcap=softcap)
    expected = reference(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_table"],
                         batch["seq_lens"], batch["query_start_loc"], scale, window, softcap)
    return out, expected


def assert_close(out, expected, dtype=torch.float32):
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.cpu().double(), expected, rtol=tol, atol=tol)


# ---- interpreter-sized cases (compiled on a CUDA machine) ----

@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_only(block_size):
    batch = make_batch([(0, 1), (5, 1), (40, 1), (17, 1)], block_size=block_size, num_heads=4, num_kv_heads=2,
                       head_dim=16)
    assert batch["max_query_len"] == 1  # decode launch
    assert_close(*run(batch))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1), (6, 2)])
def test_decode_gqa(num_heads, num_kv_heads):
    batch = make_batch([(9, 1), (33, 1)], block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=16)
    assert_close(*run(batch))


@pytest.mark.parametrize("num_splits,block_size,num_kv_heads", [(2, 16, 2), (3, 1, 1), (5, 4, 2)])
def test_split_kv_decode(num_splits, block_size, num_kv_heads):
    """Key shares merged afterwards, including empty shares (1-key rows) and seq_len-0 padding rows."""
    rows = [(60, 1), (0, 1), pad_row(1), (100, 1), (17, 1)]
    batch = make_batch(rows, block_size=block_size, num_heads=4, num_kv_heads=num_kv_heads, head_dim=16)
    out, expected = run(batch, num_kv_splits=num_splits)
    assert_close(out, expected)
    assert torch.all(out[2] == 0)


def test_prefill_without_prefix():
    batch = make_batch([(0, 20), (0, 3), (0, 37)], block_size=16, num_heads=4, num_kv_heads=2, head_dim=16)
    assert_close(*run(batch))


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_prefill_with_cached_prefix(num_kv_heads):
    batch = make_batch([(32, 5), (7, 19), (50, 2)], block_size=16, num_heads=4, num_kv_heads=num_kv_heads,
                       head_dim=16)
    assert_close(*run(batch))


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_batch(block_size):
    """Decodes, a fresh prefill, a prefix-cached prefill, a chunk, and graph padding rows in one call."""
    rows = [(12, 1), (0, 9), (40, 1), pad_row(1), (25, 14), (0, 1), (3, 30), pad_row(2)]
    batch = make_batch(rows, block_size=block_size, num_heads=4, num_kv_heads=1, head_dim=16, seed=block_size)
    out, expected = run(batch)
    assert_close(out, expected)
    qsl = batch["query_start_loc"].tolist()
    assert torch.all(out[qsl[3]:qsl[4]] == 0) and torch.all(out[qsl[7]:qsl[8]] == 0)


# A runner's mixed step: one-token rows first (shortest context first), then prefills and chunks.
MIXED_STEP = [(0, 1), (12, 1), (40, 1), (70, 1), (0, 9), (25, 14), (3, 30), (16, 2)]


@pytest.mark.parametrize("block_size,num_kv_splits,dtype", [(16, 1, torch.float32), (1, 1, torch.float32),
                                                            (4, 2, torch.float32), (16, 1, torch.float16)])
def test_mixed_step_sends_its_decode_rows_through_the_decode_launch(block_size, num_kv_splits, dtype):
    """The leading one-token rows of a mixed step through the decode launch and the rest through the
    general one: the outputs of one general launch over every row (the previous path)."""
    batch = make_batch(MIXED_STEP, block_size=block_size, num_heads=4, num_kv_heads=2, head_dim=16, dtype=dtype,
                       seed=11)
    launches = attention_launches(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_table"],
                                  batch["seq_lens"], batch["query_start_loc"], max_query_len=batch["max_query_len"],
                                  scale=1.0, out=torch.empty_like(batch["q"]), tiles=SMALL,
                                  num_kv_splits=num_kv_splits, num_decode_rows=4)
    kinds = [launch.kwargs.get("DECODE") for launch in launches]
    assert kinds == ([True, None, False] if num_kv_splits > 1 else [True, False])  # None: the merge
    assert launches[0].grid == (4, 2, num_kv_splits)
    general_only, expected = run(batch)
    split, _ = run(batch, num_kv_splits=num_kv_splits, num_decode_rows=4)
    assert_close(split, expected, dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(split, general_only, rtol=tol, atol=tol)


def test_mixed_step_with_default_tiles_and_decode_rows_only_before_one_prefill():
    rows = [(5, 1), (300, 1), (0, 1), (0, 150)]
    batch = make_batch(rows, block_size=16, num_heads=4, num_kv_heads=1, head_dim=16, seed=12)
    general_only, expected = run(batch, tiles=None)
    split, _ = run(batch, tiles=None, num_decode_rows=3)
    assert_close(split, expected)
    torch.testing.assert_close(split, general_only, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window,softcap,num_kv_splits,block_size", [
    (7, None, 1, 16), (20, None, 3, 4), (1, None, 1, 1), (None, 2.0, 1, 16), (9, 3.0, 2, 16), (500, None, 1, 16)])
def test_sliding_window_and_softcap(window, softcap, num_kv_splits, block_size):
    """A mixed step (decode rows through the decode launch, split or not; prompts with and without a
    cached prefix through the general one) under a window and a logit cap, against float64."""
    batch = make_batch(MIXED_STEP, block_size=block_size, num_heads=4, num_kv_heads=2, head_dim=16, seed=13)
    out, expected = run(batch, num_kv_splits=num_kv_splits, num_decode_rows=4, window=window, softcap=softcap)
    assert_close(out, expected)


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_blocks_before_the_window_are_never_read(num_kv_splits):
    """NaN in every block wholly before all of a row's windows (the engine may have handed them to
    another request) changes nothing."""
    block_size, window = 4, 6
    batch = make_batch(MIXED_STEP, block_size=block_size, num_heads=4, num_kv_heads=2, head_dim=16, seed=14)
    before, expected = run(batch, num_kv_splits=num_kv_splits, num_decode_rows=4, window=window)
    qsl, lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    for r, seq_len in enumerate(lens):
        first_key = max(0, seq_len - (qsl[r + 1] - qsl[r]) - window + 1)  # the row's first query's
        for b in batch["block_table"][r, :first_key // block_size].tolist():
            batch["k_cache"][:, b] = float("nan")
            batch["v_cache"][:, b] = float("nan")
    after, _ = run(batch, num_kv_splits=num_kv_splits, num_decode_rows=4, window=window)
    assert_close(before, expected)
    assert torch.equal(before, after)


def test_padding_rows_and_spare_tokens():
    """seq_len-0 rows write zeros; tokens after the last row are left as they were."""
    batch = make_batch([pad_row(1), (6, 1), pad_row(1)], block_size=4, num_heads=2, num_kv_heads=2,
                       head_dim=16, spare_tokens=2)
    out, expected = run(batch)
    assert torch.isnan(out[3:]).all()
    assert_close(out[:3], expected[:3])
    assert torch.all(out[0] == 0) and torch.all(out[2] == 0)
    prefill = make_batch([(0, 4), pad_row(3)], block_size=4, num_heads=2, num_kv_heads=1, head_dim=16,
                         spare_tokens=1)
    out, expected = run(prefill)
    assert torch.isnan(out[7:]).all()
    assert_close(out[:7], expected[:7])


def test_odd_head_dim_and_int64_metadata():
    batch = make_batch([(10, 1), (4, 6)], block_size=2, num_heads=4, num_kv_heads=2, head_dim=12,
                       block_table_dtype=torch.int64)
    batch["seq_lens"], batch["query_start_loc"] = batch["seq_lens"].long(), batch["query_start_loc"].long()
    assert_close(*run(batch))


def test_fp16():
    """16-bit inputs: the probabilities are rounded to fp16 for the second product. (The interpreter
    cannot run bf16 dots; bf16 is covered by the CUDA tests.)"""
    batch = make_batch([(30, 1), (0, 12), (9, 20), pad_row(1)], block_size=4, num_heads=4, num_kv_heads=2,
                       head_dim=16, dtype=torch.float16)
    assert_close(*run(batch), dtype=torch.float16)
    decode = make_batch([(30, 1), (2, 1)], block_size=4, num_heads=4, num_kv_heads=1, head_dim=16,
                        dtype=torch.float16)
    assert_close(*run(decode, num_kv_splits=2), dtype=torch.float16)


def test_default_tiles():
    batch = make_batch([(21, 1), (0, 11), (70, 40)], block_size=16, num_heads=4, num_kv_heads=2, head_dim=16)
    assert_close(*run(batch, tiles=None))
    decode = make_batch([(21, 1), (90, 1)], block_size=16, num_heads=4, num_kv_heads=2, head_dim=16)
    assert_close(*run(decode, tiles=None))


def test_strided_q_out_and_token_major_cache():
    """q/out as views into wider tensors and a [blocks, block_size, kv_heads, hd] cache seen head-major."""
    batch = make_batch([(8, 1), (3, 9)], block_size=4, num_heads=4, num_kv_heads=2, head_dim=16)
    _, expected = run(batch)
    q = batch["q"]
    wide = torch.zeros(q.shape[0], q.shape[1], 3 * q.shape[2], dtype=q.dtype, device=q.device)
    wide[:, :, 16:32] = q
    batch["q"] = wide[:, :, 16:32]
    for name in ("k_cache", "v_cache"):
        token_major = batch[name].permute(1, 2, 0, 3).contiguous()
        batch[name] = token_major.permute(2, 0, 1, 3)
    out_wide = torch.full_like(wide, float("nan"))
    out, _ = run(batch, out=out_wide[:, :, 32:48])
    assert_close(out, expected)
    assert torch.isnan(out_wide[:, :, :32]).all()


def test_chunked_prefill_matches_whole_prefill():
    """A sequence prefilled in three chunks (each writing its K/V first) equals one whole prefill."""
    block_size, num_kv_heads, head_dim, total = 4, 2, 16, 23
    g = torch.Generator().manual_seed(3)
    q = torch.randn(total, 4, head_dim, generator=g).to(DEVICE)
    k = torch.randn(total, num_kv_heads, head_dim, generator=g).to(DEVICE)
    v = torch.randn(total, num_kv_heads, head_dim, generator=g).to(DEVICE)
    blocks = torch.tensor([5, 2, 7, 1, 4, 6], device=DEVICE)
    block_table = blocks[None].to(torch.int32)
    offsets = torch.arange(block_size, device=DEVICE).repeat(len(blocks))
    slots = blocks.repeat_interleave(block_size) * block_size + offsets
    scale = head_dim ** -0.5

    def attend(chunks):
        k_cache = torch.zeros(num_kv_heads, 8, block_size, head_dim, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        out = torch.full_like(q, float("nan"))
        done = 0
        for n in chunks:
            write_kv(k[done:done + n], v[done:done + n], k_cache, v_cache, slots[done:done + n])
            paged_attention(q[done:done + n], k_cache, v_cache, block_table,
                            torch.tensor([done + n], dtype=torch.int32, device=DEVICE),
                            torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
                            max_query_len=n, scale=scale, out=out[done:done + n], tiles=SMALL)
            done += n
        return out

    whole, chunked = attend([total]), attend([7, 9, 7])
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


def test_write_kv_matches_index_copy_and_skips_padding():
    num_kv_heads, num_blocks, block_size, head_dim = 3, 5, 4, 12  # non-power-of-two heads and head_dim
    g = torch.Generator().manual_seed(1)
    k = torch.randn(6, num_kv_heads, head_dim, generator=g).to(DEVICE)
    v = torch.randn(6, num_kv_heads, head_dim, generator=g).to(DEVICE)
    slots = torch.tensor([7, -1, 0, 19, -1, 10], device=DEVICE)
    k_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=g).to(DEVICE)
    v_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=g).to(DEVICE)
    expected = sdpa.LayerKV(k_cache.clone(), v_cache.clone(), scratch=None)
    keep = slots >= 0
    sdpa.write_kv(expected, k[keep], v[keep], slots[keep])
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected.k_cache) and torch.equal(v_cache, expected.v_cache)


def test_write_kv_strided_inputs_and_half_cache():
    """k/v as column slices of a fused projection; a 16-bit cache gets the values rounded to its dtype."""
    num_kv_heads, head_dim = 2, 16
    fused = torch.randn(5, 3 * num_kv_heads * head_dim, device=DEVICE)
    k = fused[:, :32].view(5, num_kv_heads, head_dim)
    v = fused[:, 64:].view(5, num_kv_heads, head_dim)
    slots = torch.tensor([3, 4, -1, 1, 8], device=DEVICE)
    k_cache = torch.zeros(num_kv_heads, 3, 4, head_dim, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    write_kv(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(num_kv_heads, -1, head_dim), v_cache.view(num_kv_heads, -1, head_dim)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[:, slot], k[t].half()) and torch.equal(flat_v[:, slot], v[t].half())
    written = slots[slots >= 0]
    untouched = torch.ones(flat_k.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.all(flat_k[:, untouched] == 0) and torch.all(flat_v[:, untouched] == 0)


# ---- GPU-sized cases ----

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (16, 2, 64), (8, 8, 128)])
def test_cuda_mixed_batch(dtype, num_heads, num_kv_heads, head_dim):
    rows = [(1500, 1), (0, 700), (3, 1), pad_row(1), (900, 300), (0, 1), (4000, 1), (64, 129)]
    rows += [(257, 1)] * 20
    batch = make_batch(rows, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       dtype=dtype, seed=7)
    out, expected = run(batch, tiles=None)
    assert_close(out, expected, dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_mixed_step_decode_rows_first(dtype):
    """As the runner lays out a mixed step: 24 one-token rows through the decode launch, then prefills."""
    rows = [(3, 1), (0, 1)] + [(257, 1)] * 20 + [(1500, 1), (4000, 1), (0, 700), (900, 300), (64, 129)]
    batch = make_batch(rows, block_size=16, num_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype, seed=8)
    out, expected = run(batch, tiles=None, num_decode_rows=24)
    assert_close(out, expected, dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("num_kv_splits", [None, 1])  # None: 8 rows * 8 kv heads gets split on any big GPU
def test_cuda_decode(dtype, block_size, num_kv_splits):
    rows = [(n, 1) for n in (1, 17, 300, 2049, 5000)] + [pad_row(1)] * 3
    batch = make_batch(rows, block_size=block_size, num_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype)
    out, expected = run(batch, tiles=None, num_kv_splits=num_kv_splits)
    assert_close(out, expected, dtype)


@needs_cuda
@pytest.mark.parametrize("max_query_len", [1, 9])
def test_cuda_graph_replay_follows_new_metadata(max_query_len):
    """Captured once, replayed after q, the cache, the block table and the lengths change in place."""
    q_len = max_query_len
    kw = dict(block_size=16, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    batches = [make_batch([(100, q_len), (5, q_len), pad_row(q_len), pad_row(q_len)], seed=1, **kw),
               make_batch([(700, q_len), (33, q_len), (2, q_len), pad_row(q_len)], seed=2, **kw)]
    num_blocks = max(b["k_cache"].shape[1] for b in batches)
    static = dict(
        q=torch.empty_like(batches[0]["q"]),
        k_cache=torch.zeros(8, num_blocks, 16, 128, dtype=torch.bfloat16, device="cuda"),
        v_cache=torch.zeros(8, num_blocks, 16, 128, dtype=torch.bfloat16, device="cuda"),
        block_table=torch.zeros(4, 64, dtype=torch.int32, device="cuda"),
        seq_lens=torch.empty_like(batches[0]["seq_lens"]),
        query_start_loc=torch.empty_like(batches[0]["query_start_loc"]),
    )

    def load(batch):
        for name in ("q", "seq_lens", "query_start_loc"):
            static[name].copy_(batch[name])
        for name in ("k_cache", "v_cache"):
            static[name][:, :batch[name].shape[1]] = batch[name]
        static["block_table"].zero_()
        static["block_table"][:, :batch["block_table"].shape[1]] = batch["block_table"]

    out = torch.zeros_like(static["q"])

    def launch():
        paged_attention(static["q"], static["k_cache"], static["v_cache"], static["block_table"],
                        static["seq_lens"], static["query_start_loc"], max_query_len=max_query_len,
                        scale=128 ** -0.5, out=out)

    load(batches[0])
    launch()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for batch in batches:
        load(batch)
        out.fill_(float("nan"))
        graph.replay()
        expected = reference(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_table"],
                             batch["seq_lens"], batch["query_start_loc"], 128 ** -0.5)
        assert_close(out, expected, torch.bfloat16)
