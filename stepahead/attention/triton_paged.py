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

from stepahead.attention.kv_splits import KernelFootprint, kv_splits, resident_blocks_per_sm
from stepahead.attention.triton_kernels import merge_kv_splits_kernel, paged_attention_kernel, write_kv_kernel


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
# Registers per thread and shared memory of one decode block with DECODE_TILES(_FP32) on sm_90 (the most
# of any block size and split count), by (fp32, BLOCK_D): upper bounds that attention/triton_aot.py (a test
# in CI) checks against the compiled kernels. They set how many blocks an SM holds, so how many splits fit.
DECODE_FOOTPRINTS = {(False, 64): (88, 21504), (False, 128): (168, 39936),
                     (True, 64): (64, 13312), (True, 128): (80, 25664)}


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
_INTERPRETED = not isinstance(paged_attention_kernel, triton.runtime.JITFunction)


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
                    num_kv_splits: int | None = None, num_decode_rows: int = 0, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Attention of the new tokens q [num_tokens, heads, hd] over their rows' paged context; writes out.

    k_cache/v_cache [kv_heads, num_blocks, block_size, hd], same strides; block_table [rows, max_blocks]
    (int32/int64, padded with block 0); seq_lens [rows] (context incl. new tokens); query_start_loc
    [rows + 1]. max_query_len is a host-side upper bound on any row's new tokens (1 selects the decode
    launch). num_decode_rows: how many leading rows have exactly one new token; in a mixed step they go
    through the decode launch and only the rest through the general one (whose 64+-row tiles would
    waste most of their work on a one-token row). `tiles` overrides the launch parameters (the
    interpreter wants small ones). num_kv_splits sets the key shares of a decode launch (None: chosen
    from its rows and the GPU). window: each token attends to itself and the window - 1 keys before it
    (the blocks wholly before that are never read); softcap: scores become softcap * tanh(score /
    softcap). Returns out.
    """
    for launch in attention_launches(q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                                     max_query_len=max_query_len, scale=scale, out=out, tiles=tiles,
                                     num_kv_splits=num_kv_splits, num_decode_rows=num_decode_rows,
                                     window=window, softcap=softcap):
        launch.run()
    return out


def attention_launches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, max_query_len: int,
                       scale: float, out: torch.Tensor, tiles: AttentionTiles | None = None,
                       num_kv_splits: int | None = None, num_decode_rows: int = 0, window: int | None = None,
                       softcap: float | None = None) -> list[KernelLaunch]:
    """The launches paged_attention runs (same arguments), in order; allocates the split-KV scratch."""
    num_tokens = q.shape[0]
    num_rows = block_table.shape[0]
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache need the same strides, got {k_cache.stride()} and {v_cache.stride()}")
    if num_rows == 0 or num_tokens == 0:
        return []
    plan = _LaunchPlan(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out, tiles, window,
                       softcap)
    if max_query_len <= 1:
        return plan.decode(num_rows, num_kv_splits)
    launches = plan.decode(num_decode_rows, num_kv_splits) if num_decode_rows else []
    return launches + [plan.general(num_decode_rows)]


@dataclass
class _LaunchPlan:
    """The arguments every attention launch of one call shares."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    out: torch.Tensor
    tiles: AttentionTiles | None
    window: int | None = None
    softcap: float | None = None

    def _tiles(self, decode: bool) -> AttentionTiles:
        if self.tiles is not None:
            return self.tiles
        if self.q.dtype == torch.float32:
            return DECODE_TILES_FP32 if decode else PREFILL_TILES_FP32
        return DECODE_TILES if decode else PREFILL_TILES

    def _attention(self, grid: tuple[int, int, int], num_rows: int, row_start: int, slot_start: int,
                   tiles: AttentionTiles, block_m: int, block_q: int, decode: bool,
                   scratch: tuple[torch.Tensor, ...]) -> KernelLaunch:
        q, out, k_cache = self.q, self.out, self.k_cache
        num_heads, head_dim = q.shape[1:]
        return KernelLaunch(paged_attention_kernel, grid, (
            q, k_cache, self.v_cache, out, self.block_table, self.seq_lens, self.query_start_loc, *scratch,
            # under a softcap the kernel caps the plain scaled scores, then takes log2(e)
            self.scale if self.softcap is not None else self.scale * math.log2(math.e),
            self.window or 0, self.softcap or 0.0, num_rows, row_start, slot_start,
            *q.stride(), *out.stride(), *k_cache.stride(), self.block_table.stride(0),
        ), dict(
            HEAD_DIM=head_dim, GROUP=num_heads // k_cache.shape[0], BLOCK_SIZE=k_cache.shape[2],
            BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=max(tiles.block_n, 16),
            BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
            DECODE=decode, NUM_SPLITS=grid[2], INTERPRETED=_INTERPRETED,
            WINDOW=self.window is not None, SOFTCAP=self.softcap is not None,
            # fp32 inputs: full-precision products (tf32 would lose ~3 digits); 16-bit inputs ignore this.
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        ))

    def _block_m(self, tiles: AttentionTiles) -> int:
        # tl.dot needs every tile dimension >= 16; a non-power-of-two head_dim is masked up to BLOCK_D.
        group = self.q.shape[1] // self.k_cache.shape[0]
        return max(tiles.block_m, triton.next_power_of_2(group), 16)

    def decode(self, num_rows: int, num_kv_splits: int | None) -> list[KernelLaunch]:
        """Rows 0..num_rows-1, one new token each: one program per (row, KV head, key share), and the
        merge of the shares when there is more than one."""
        q, out = self.q, self.out
        num_heads, head_dim = q.shape[1:]
        num_kv_heads = self.k_cache.shape[0]
        tiles = self._tiles(decode=True)
        num_splits = num_kv_splits
        if num_splits is None:
            block_d = max(triton.next_power_of_2(head_dim), 16)
            num_splits = _auto_kv_splits(q, num_rows, num_kv_heads, block_d, tiles.num_warps)
        scratch = (out, out, out)  # placeholders: the kernel touches them only when splitting
        if num_splits > 1:
            shape = (num_rows, num_heads, num_splits)
            scratch = (torch.empty(*shape, head_dim, dtype=torch.float32, device=q.device),
                       torch.empty(shape, dtype=torch.float32, device=q.device),
                       torch.empty(shape, dtype=torch.float32, device=q.device))
        launches = [self._attention((num_rows, num_kv_heads, num_splits), num_rows, 0, 0, tiles,
                                    self._block_m(tiles), 1, True, scratch)]
        if num_splits > 1:
            launches.append(KernelLaunch(merge_kv_splits_kernel, (num_rows, num_heads), (
                out, *scratch, self.query_start_loc, *out.stride(),
            ), dict(
                HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
                BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
            )))
        return launches

    def general(self, row_start: int) -> KernelLaunch:
        """Rows row_start.. (rows before it have one token each): BLOCK_Q-token tiles of each row, a
        program per tile slot from row_start's first on."""
        num_tokens = self.q.shape[0]
        num_rows = self.block_table.shape[0]
        tiles = self._tiles(decode=False)
        block_m = self._block_m(tiles)
        block_q = block_m // (self.q.shape[1] // self.k_cache.shape[0])
        # Row r's first tile slot is query_start_loc[r] // BLOCK_Q + r, and a one-token row before
        # row_start makes query_start_loc[row_start] == row_start.
        slot_start = row_start // block_q + row_start
        grid = (num_tokens // block_q + num_rows - slot_start, self.k_cache.shape[0], 1)
        return self._attention(grid, num_rows, row_start, slot_start, tiles, block_m, block_q, False,
                               (self.out, self.out, self.out))


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
    return KernelLaunch(write_kv_kernel, (num_tokens,), (
        k, v, k_cache, v_cache, slot_mapping, k_cache.shape[2],
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
    ), dict(
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    ))
