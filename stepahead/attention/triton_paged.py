"""Paged attention over a mixed prefill + decode batch, and the KV write before it, as Triton kernels.

Cache: one K and one V tensor per layer, [num_kv_heads, num_blocks, block_size, head_dim] as in
`stepahead.attention.sdpa`. The kernels take every stride as an argument, so another order of these four
axes needs no kernel change; K and V must have the same strides (attention reads both at one offset).

Batch: q and out are [num_tokens, num_heads, head_dim], the new tokens of every row back to back. Row r owns
tokens query_start_loc[r]:query_start_loc[r + 1] and has seq_lens[r] tokens of context in all, its new tokens
included (already in the cache). New token i of a row with q_len new tokens sits at position
seq_len - q_len + i and attends keys 0..position: causal within the new tokens, full over the cached prefix.

Program tile: one program owns one KV head and BLOCK_Q consecutive new tokens of one row, together with the
GROUP = num_heads // num_kv_heads query heads that read that KV head. The tile's M axis (BLOCK_M >= 16, as
tl.dot needs) holds (token, head) pairs token-major, m -> (m // GROUP, m % GROUP), so each K/V tile is
loaded once for the whole group. The program walks key positions 0 .. (its last query position) in steps of
BLOCK_N, maps each position to its cache slot through the block table (block_table[r, pos // block_size],
offset pos % block_size, so any block size works, 1 included) and keeps an online softmax in fp32.

Grids depend only on host ints, never on device data, so a launch can be captured in a CUDA graph:
- decode (max_query_len == 1): (num_rows, num_kv_heads); BLOCK_Q = 1 and program i takes row i.
- general: (num_tokens // BLOCK_Q + num_rows, num_kv_heads). Row r's tiles start at slot
  query_start_loc[r] // BLOCK_Q + r, which leaves it at least cdiv(q_len, BLOCK_Q) slots; a program finds
  its row by binary search over these starts and exits if its slot is past the row's last tile. A
  (num_rows, cdiv(max_query_len, BLOCK_Q)) grid would instead launch mostly idle programs for a batch of
  many decodes plus one long prefill.
- split-KV decode, when num_rows * num_kv_heads programs would fill the GPU's waves of resident blocks
  poorly (few rows, or a last wave mostly idle; the count from attention/kv_splits.py):
  (num_rows, num_kv_heads, num_splits). Split s takes the s-th equal share of
  the row's keys and stores its unnormalised state (acc, running max, running sum) in fp32 scratch; a
  second kernel, grid (num_rows, num_heads), merges the shares into out.
Tokens of a row with seq_len 0 (padding rows of a captured graph) get zeros; tokens past
query_start_loc[-1] are left untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import triton
import triton.language as tl

from stepahead.attention.kv_splits import KernelFootprint, kv_splits, resident_blocks_per_sm


@dataclass(frozen=True)
class AttentionTiles:
    """Launch parameters of one attention launch (decode or general)."""

    block_m: int  # (token, head) pairs per program; raised to the next power of two >= GQA group size
    block_n: int  # key positions per inner-loop step
    num_warps: int
    num_stages: int


# Chosen for H100/H200-class GPUs with head_dim 64/128 (checked to compile for sm_90 without spills).
# Decode is bandwidth bound: one 16-row M tile (the GQA group, padded for tl.dot), wide key steps and three
# stages so the gathered K/V of the next steps is in flight. General launches are compute bound on long
# prefills: 128-row tiles on 8 warps (Hopper warp-group MMA), two stages (~96 KB of shared memory at hd 128).
DECODE_TILES = AttentionTiles(block_m=16, block_n=64, num_warps=4, num_stages=3)
PREFILL_TILES = AttentionTiles(block_m=128, block_n=64, num_warps=8, num_stages=2)
# fp32 (tests) has no full-precision tensor-core path: these keep the FMA dots free of register spills.
DECODE_TILES_FP32 = AttentionTiles(block_m=16, block_n=16, num_warps=4, num_stages=2)
PREFILL_TILES_FP32 = AttentionTiles(block_m=64, block_n=16, num_warps=8, num_stages=2)
# Split-KV decode: counts sized to whole waves of resident blocks (attention/kv_splits.py); powers of
# two (few compiled variants), and more shares than 16 only add merge work.
KV_SPLIT_CHOICES = (1, 2, 4, 8, 16)
# Registers per thread and shared memory of one decode block with DECODE_TILES(_FP32) on sm_90, split
# variants (the most of any block size), by (fp32, BLOCK_D): upper bounds tests/attention/test_triton_aot.py
# checks against the compiled kernels. They set how many blocks an SM holds, so how many splits fit.
DECODE_FOOTPRINTS = {(False, 64): (88, 21504), (False, 128): (168, 39936),
                     (True, 64): (64, 13312), (True, 128): (72, 25664)}


@triton.jit
def _attend_key_tile(acc, m_i, l_i, start, q, q_pos, kv_end, qk_scale, block_table_row, k_head, v_head,
                     stride_cb, stride_cs, stride_cd, offs_n, offs_d, d_ok,
                     BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over key positions start + offs_n (those < kv_end and <= each query's)."""
    pos = start + offs_n
    pos_ok = pos < kv_end
    # int64: block * stride overflows int32 on large caches. K and V share their strides, so the one
    # 64-bit offset per key serves both (two cost ~30 registers a thread).
    block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    key_offset = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs
    k = tl.load(k_head + key_offset[None, :] + offs_d[:, None] * stride_cd,
                mask=pos_ok[None, :] & d_ok[:, None], other=0.0)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no visible key yet keeps max -inf; subtract 0 there so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    v = tl.load(v_head + key_offset[:, None] + offs_d[None, :] * stride_cd,
                mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


# num_rows and the block table's width change every step: specialising on them (Triton specialises ints
# equal to 1 or divisible by 16) would compile new variants while serving.
@triton.jit(do_not_specialize=["num_rows", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    split_acc_ptr, split_max_ptr, split_sum_ptr,  # split-KV scratch; unused when NUM_SPLITS == 1
    qk_scale,  # softmax scale * log2(e): the kernel exponentiates with exp2
    num_rows,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_ch, stride_cb, stride_cs, stride_cd,  # of k_cache and v_cache alike
    stride_bt,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DECODE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):
    kv_head = tl.program_id(1)
    if DECODE:
        row = tl.program_id(0)
        q_tile = 0
    else:
        # Largest row whose first tile slot is <= this program's slot.
        slot = tl.program_id(0)
        lo = tl.full([], 0, tl.int32)
        hi = tl.full([], 0, tl.int32) + num_rows - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid <= slot:
                lo = mid
            else:
                hi = mid - 1
        row = lo
        q_tile = slot - (tl.load(query_start_loc_ptr + row).to(tl.int32) // BLOCK_Q + row)

    # Per-row metadata as int32 whatever its dtype (the staging buffer is int64): token indices,
    # positions and lengths fit, and 64-bit index math costs ~40 registers a thread (one resident block
    # less per SM). Only the products that address the cache (block * stride) are widened to int64.
    q_start = tl.load(query_start_loc_ptr + row).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + row + 1).to(tl.int32) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_local = q_tile * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_local < q_len)
    d_ok = offs_d < HEAD_DIM
    tok = q_start + q_local
    q_pos = context_len + q_local

    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys past the tile's last query position are masked for every row of the tile: stop there.
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
    block_table_row = block_table_ptr + row.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_ch
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_ch
    kv_start = 0
    if NUM_SPLITS > 1:
        # This program's share of the keys: equal shares rounded up to whole key steps (some may be empty).
        split = tl.program_id(2)
        share = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_start = split * share
        kv_end = tl.minimum(kv_end, kv_start + share)
    if INTERPRETED:
        # Triton's interpreter cannot use a device value as a range() bound under NumPy >= 2.4; compiled
        # code keeps the for loop, which Triton software-pipelines (num_stages) and a while loop it does not.
        start = kv_start
        while start < kv_end:
            acc, m_i, l_i = _attend_key_tile(
                acc, m_i, l_i, start, q, q_pos, kv_end, qk_scale, block_table_row, k_head, v_head,
                stride_cb, stride_cs, stride_cd, offs_n, offs_d, d_ok,
                BLOCK_SIZE, DOT_PRECISION)
            start += BLOCK_N
    else:
        for start in range(kv_start, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_key_tile(
                acc, m_i, l_i, start, q, q_pos, kv_end, qk_scale, block_table_row, k_head, v_head,
                stride_cb, stride_cs, stride_cd, offs_n, offs_d, d_ok,
                BLOCK_SIZE, DOT_PRECISION)

    if NUM_SPLITS > 1:
        # Scratch is [num_rows, num_heads, NUM_SPLITS] (+ [HEAD_DIM] for acc); empty shares store max -inf,
        # sum 0 and acc 0, which the merge weighs as nothing.
        part = (row * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(split_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(split_max_ptr + part, m_i, mask=row_ok)
        tl.store(split_sum_ptr + part, l_i, mask=row_ok)
    else:
        # Rows that saw no key (seq_len 0 padding rows) store zeros.
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_kv_splits_kernel(
    out_ptr, split_acc_ptr, split_max_ptr, split_sum_ptr, query_start_loc_ptr,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(query_start_loc_ptr + row).to(tl.int32)
    if tl.load(query_start_loc_ptr + row + 1).to(tl.int32) == tok:  # no new token: the attention kernel wrote nothing
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    part = (row * tl.num_programs(1) + head) * NUM_SPLITS + offs_s
    share_max = tl.load(split_max_ptr + part, mask=s_ok, other=float("-inf"))
    share_sum = tl.load(split_sum_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(split_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m_all = tl.max(share_max, 0)
    # Rescale every share to the overall max (exp2: maxima are in log2 units); max -inf means no key at all.
    weight = tl.math.exp2(share_max - tl.where(m_all == float("-inf"), 0.0, m_all))
    total = tl.sum(weight * share_sum, 0)
    o = tl.sum(weight[:, None] * acc, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=d_ok)


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch planned on the host: run now, or compiled ahead of time (attention/triton_aot.py)."""

    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict[str, Any]  # constexprs and launch options

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)


# Under TRITON_INTERPRET=1 (set before import) @triton.jit yields interpreted functions instead.
_INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


@cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_footprint(fp32: bool, block_d: int, num_warps: int) -> KernelFootprint:
    """One decode block's registers and shared memory (measured at BLOCK_D 64 and 128; scaled beyond)."""
    registers, shared = DECODE_FOOTPRINTS[fp32, min(max(block_d, 64), 128)]
    if block_d > 128:
        registers, shared = 255, shared * block_d // 128
    return KernelFootprint(registers, shared, num_warps)


def _auto_kv_splits(q: torch.Tensor, num_rows: int, num_kv_heads: int, block_d: int, num_warps: int) -> int:
    """Key shares per decode row that fill whole waves of resident blocks; 1 off CUDA."""
    if not q.is_cuda:
        return 1
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    blocks = resident_blocks_per_sm(decode_footprint(q.dtype == torch.float32, block_d, num_warps))
    return kv_splits(num_rows * num_kv_heads, _sm_count(device), blocks, KV_SPLIT_CHOICES)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, max_query_len: int,
                    scale: float, out: torch.Tensor, tiles: AttentionTiles | None = None,
                    num_kv_splits: int | None = None) -> torch.Tensor:
    """Attention of the new tokens q [num_tokens, heads, hd] over their rows' paged context; writes out.

    k_cache/v_cache [kv_heads, num_blocks, block_size, hd]; block_table [rows, max_blocks] (int32/int64,
    padded with block 0); seq_lens [rows] (context incl. new tokens); query_start_loc [rows + 1].
    max_query_len is a host-side upper bound on any row's new tokens (1 selects the decode launch).
    `tiles` overrides the launch parameters (the interpreter wants small ones). num_kv_splits sets the
    key shares of a decode launch (None: chosen from the batch and the GPU's SM count; ignored unless
    max_query_len == 1). Returns out.
    """
    for launch in attention_launches(q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                                     max_query_len=max_query_len, scale=scale, out=out, tiles=tiles,
                                     num_kv_splits=num_kv_splits):
        launch.run()
    return out


def attention_launches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, max_query_len: int,
                       scale: float, out: torch.Tensor, tiles: AttentionTiles | None = None,
                       num_kv_splits: int | None = None) -> list[KernelLaunch]:
    """The launches paged_attention runs (same arguments), in order; allocates the split-KV scratch."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _num_blocks, block_size, _ = k_cache.shape
    num_rows = block_table.shape[0]
    group = num_heads // num_kv_heads
    decode = max_query_len <= 1
    if tiles is None:
        fp32 = q.dtype == torch.float32
        tiles = (DECODE_TILES_FP32 if fp32 else DECODE_TILES) if decode else \
            (PREFILL_TILES_FP32 if fp32 else PREFILL_TILES)
    # tl.dot needs every tile dimension >= 16; a non-power-of-two head_dim is masked up to BLOCK_D.
    block_m = max(tiles.block_m, triton.next_power_of_2(group), 16)
    block_q = 1 if decode else block_m // group
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache need the same strides, got {k_cache.stride()} and {v_cache.stride()}")
    if num_rows == 0 or num_tokens == 0:
        return []
    num_splits = 1
    if decode:
        block_d = max(triton.next_power_of_2(head_dim), 16)
        num_splits = _auto_kv_splits(q, num_rows, num_kv_heads, block_d, tiles.num_warps) \
            if num_kv_splits is None else num_kv_splits
    grid = (num_rows if decode else num_tokens // block_q + num_rows, num_kv_heads, num_splits)
    split_acc = split_max = split_sum = out  # placeholders: the kernel touches them only when splitting
    if num_splits > 1:
        shape = (num_rows, num_heads, num_splits)
        split_acc = torch.empty(*shape, head_dim, dtype=torch.float32, device=q.device)
        split_max = torch.empty(shape, dtype=torch.float32, device=q.device)
        split_sum = torch.empty_like(split_max)
    launches = [KernelLaunch(_paged_attention_kernel, grid, (
        q, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, split_acc, split_max, split_sum,
        scale * math.log2(math.e), num_rows,
        *q.stride(), *out.stride(), *k_cache.stride(), block_table.stride(0),
    ), dict(
        HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=max(tiles.block_n, 16),
        BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        DECODE=decode, NUM_SPLITS=num_splits, INTERPRETED=_INTERPRETED,
        # fp32 inputs: full-precision products (tf32 would lose ~3 digits); 16-bit inputs ignore this.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    ))]
    if num_splits > 1:
        launches.append(KernelLaunch(_merge_kv_splits_kernel, (num_rows, num_heads), (
            out, split_acc, split_max, split_sum, query_start_loc, *out.stride(),
        ), dict(
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
        )))
    return launches


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kch, stride_kcb, stride_kcs, stride_kcd,
    stride_vch, stride_vcb, stride_vcs, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // block_size
    in_block = slot % block_size
    h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]  # head * stride overflows int32 on large caches
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + tok * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(k_cache_ptr + h * stride_kch + block * stride_kcb + in_block * stride_kcs + d * stride_kcd,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + h * stride_vch + block * stride_vcb + in_block * stride_vcs + d * stride_vcd,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k/v [num_tokens, kv_heads, hd] at flat slots (block * block_size + offset); slot -1 skips."""
    launch = write_kv_launch(k, v, k_cache, v_cache, slot_mapping)
    if launch is not None:
        launch.run()


def write_kv_launch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> KernelLaunch | None:
    """The launch write_kv runs (same arguments); None when there is no token."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return None
    # One program per token, covering all its KV heads: a token's K/V is a few KB at most.
    return KernelLaunch(_write_kv_kernel, (num_tokens,), (
        k, v, k_cache, v_cache, slot_mapping, k_cache.shape[2],
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
    ), dict(
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    ))
