"""Attention over the paged KV cache with torch SDPA or stepahead's CPU kernel (the CPU path): a mixed
prefill + decode batch.

With `decode_kernel` (float32 on CPU where stepahead's kernels build) every token of the step, a
decode row's or a prompt's, is one row of stepahead's kernel (kernels/paged_decode.cpp): its query
attends to its request's keys up to its own position, read through the request's block table where
they lie (no gather, no padding, no mask), in one call per layer. A token's attention then depends on
its position and the cached keys alone, never on how its prompt was split into chunks, whether its
prefix came from the prefix cache, or what else is in the batch: chunked equals unchunked, cached
equals uncached and preempted equals unpreempted, bitwise.

Without it, a request's context is gathered block-wise from the head-major cache
(attention/paged_cache.py) with one `index_select(out=...)` into a reusable buffer, and the gathered
[kv_heads, rows, tokens, head_dim] tensor feeds SDPA with every (head, row) slab contiguous (measured
faster than token-major for both the gather and SDPA on CPU). The flattened batch is ordered by the
model runner as: single-token rows first (decodes, and one-token prefill chunks) sorted by context
length, then multi-token rows. Single-token rows are attended in a few padded SDPA calls, one per
padded width (padded_blocks: a width that depends on the row alone, so a token's attention is bitwise
the same whatever else is in its batch). Each multi-token row gets its own SDPA call (same-length
fresh prompts side by side share one), causal within its new tokens and full over its cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from stepahead.attention import dense, windowed
from stepahead.attention.paged_cache import LayerKV
from stepahead.attention.rows import BatchRow, stage_block_table
from stepahead.kernels import cpu_build, cpu_ops


@dataclass
class PrefillRow:
    """One multi-token row of the batch: tokens [start, end) of the flattened batch."""

    start: int
    end: int
    context_len: int  # tokens already in the cache before this step
    block_table: torch.Tensor | None  # [num_blocks] long; None when context_len == 0 (no gather needed)
    mask: torch.Tensor | None  # [1, 1, n, context_len + n] bool; None when context_len == 0 (plain causal)


@dataclass
class DecodeGroup:
    """Tokens [start, end) of the flattened batch, each a row of one query attended in one call.

    For SDPA a group holds single-token rows (the runner sorts them by context length) of one padded
    width; for the decode kernel there is one group of every token of the step."""

    start: int
    end: int
    block_table: torch.Tensor  # [rows, width] long: each row's request's table (padding points at null block 0)
    seq_lens: torch.Tensor  # [rows] long: keys per row, its own token included
    mask: torch.Tensor | None  # SDPA's [1, rows, 1, width * block_size] bool: key is valid (None: the kernel)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built by the model runner, passed down explicitly."""

    slot_mapping: torch.Tensor  # [num_tokens] long: flat slot (block * block_size + offset) of each new token
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillRow] = field(default_factory=list)
    decode_kernel: bool = False  # every token runs stepahead's CPU kernel instead of SDPA
    prompt_tokens: bool = False  # with decode_kernel: some rows are prompt tokens
    # What each group or row reads under a window, made by the first layer of that window and reused
    # by the others: (first token of the group or row, window) -> its blocks and mask.
    windows: dict[tuple[int, int], windowed.WindowedKeys] = field(default_factory=dict)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, scale: float,
               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        return paged_attention(q, k, v, kv, self, scale, window, softcap)

    def windowed(self, start: int, window: int, make, *args) -> windowed.WindowedKeys:
        """What the group or row beginning at token `start` reads under `window`: make(*args) the
        first time."""
        keys = self.windows.get((start, window))
        if keys is None:
            keys = self.windows[start, window] = make(*args)
        return keys

    def single_decode_group(self) -> DecodeGroup | None:
        """The step's only group when every row is a decode row for the kernel (what DecodeStack runs)."""
        if self.decode_kernel and not self.prompt_tokens and len(self.decode_groups) == 1:
            return self.decode_groups[0]
        return None


def padded_blocks(blocks: int) -> int:
    """The table width a decode row needing `blocks` blocks is padded to: the next of 1, 2, 3, 4, 6, 8,
    12, 16, 24, ... (at most 1.5x the row's blocks). It depends on the row alone, so a row's keys, and with
    them SDPA's summation order and its output bits, are the same in any batch."""
    width = 1
    while width < blocks:
        if width >= 2 and width * 3 // 2 >= blocks:
            return width * 3 // 2
        width *= 2
    return width


def decode_groups(blocks_needed: list[int], max_blocks: int) -> list[tuple[int, int, int]]:
    """Split rows sorted by block count into [start, end) groups of one padded width: (start, end, width),
    the width capped at max_blocks (a sequence's most blocks, a constant of the engine).

    Padding a row to its group's longest row would make its attention output depend on the other rows
    (a longer padded length changes how SDPA splits and sums the keys, in the last bits); padding every
    row to padded_blocks(its own blocks) does not, at the price of a call per width present."""
    widths = [min(padded_blocks(b), max_blocks) for b in blocks_needed]
    groups, start = [], 0
    for i in range(1, len(widths) + 1):
        if i == len(widths) or widths[i] != widths[start]:
            groups.append((start, i, widths[start]))
            start = i
    return groups


@dataclass
class StagedMetadata:
    """Where stage_metadata put the block tables and lengths in the staging buffer; finish() turns them
    into device views once the buffer is uploaded."""

    decode_groups: list[tuple[int, int, int, int]]  # (first row, end row, table width, table offset)
    prefills: list[tuple[BatchRow, int | None]]  # (row, table offset or None without a cached prefix)
    lens_offset: int

    def finish(self, slot_mapping: torch.Tensor, staging, block_size: int,
               arange: torch.Tensor) -> AttentionMetadata:
        """Device views of what stage_metadata wrote, valid once the staging buffer is uploaded."""
        groups = []
        for first, end, width, table_offset in self.decode_groups:
            rows = end - first
            lens = staging.view(self.lens_offset + first, rows)
            keys = arange[: width * block_size]
            mask = (keys.unsqueeze(0) < lens.unsqueeze(1)).view(1, rows, 1, width * block_size)
            # Decode rows come first and hold one token each: row index == token index.
            table = staging.view(table_offset, rows * width, (rows, width))
            groups.append(DecodeGroup(first, end, table, lens, mask))
        prefills = []
        for row, prefix_offset in self.prefills:
            end = row.start + row.num_new_tokens
            if prefix_offset is None:
                prefills.append(PrefillRow(row.start, end, 0, None, None))
                continue
            new, cached = row.num_new_tokens, row.num_computed_tokens
            keys = arange[: cached + new]
            mask = (keys.unsqueeze(0) <= (arange[:new] + cached).unsqueeze(1)).view(1, 1, new, cached + new)
            table = staging.view(prefix_offset, row.blocks_needed(block_size))
            prefills.append(PrefillRow(row.start, end, cached, table, mask))
        return AttentionMetadata(slot_mapping, groups, prefills)


@dataclass
class StagedKernelRows:
    """Where stage_kernel_rows put the kernel's inputs in the staging buffer: the requests' tables
    [requests, width], the keys of each token, and (with prompt tokens) each token's request."""

    num_tokens: int
    num_requests: int
    width: int
    table_offset: int
    lens_offset: int
    token_requests_offset: int | None  # None: one token per request, row index == token index

    def finish(self, slot_mapping: torch.Tensor, staging, block_size: int,
               arange: torch.Tensor) -> AttentionMetadata:
        table = staging.view(self.table_offset, self.num_requests * self.width, (self.num_requests, self.width))
        if self.token_requests_offset is not None:
            # each token's request's table (one index_select a step, shared by every layer)
            table = table.index_select(0, staging.view(self.token_requests_offset, self.num_tokens))
        group = DecodeGroup(0, self.num_tokens, table, staging.view(self.lens_offset, self.num_tokens), None)
        return AttentionMetadata(slot_mapping, [group] if self.num_tokens else [], [], True,
                                 self.token_requests_offset is not None)


def stage_kernel_rows(rows: list[BatchRow], staging, block_size: int) -> StagedKernelRows:
    """The decode kernel's inputs for every token of the step (host side): token i of a request whose
    first new token is at position c attends to keys 0 .. c + i, its own included."""
    num_tokens = sum(row.num_new_tokens for row in rows)
    width = max((row.blocks_needed(block_size) for row in rows), default=1)
    table_offset = stage_block_table(rows, width, block_size, staging)
    lens, lens_offset = staging.alloc(num_tokens)
    token_requests_offset = None
    if num_tokens == len(rows):
        for b, row in enumerate(rows):
            lens[b] = row.num_computed_tokens + 1
    else:
        token_requests, token_requests_offset = staging.alloc(num_tokens)
        for b, row in enumerate(rows):
            end = row.start + row.num_new_tokens
            lens[row.start:end] = np.arange(row.num_computed_tokens + 1, row.num_computed_tokens + row.num_new_tokens + 1)
            token_requests[row.start:end] = b
    return StagedKernelRows(num_tokens, len(rows), width, table_offset, lens_offset, token_requests_offset)


def stage_metadata(rows: list[BatchRow], num_decode_rows: int, staging, block_size: int,
                   max_blocks: int) -> StagedMetadata:
    """Write block tables and context lengths into the step's staging buffer (host side), for SDPA.

    The batch's first num_decode_rows rows are single-token rows sorted by context length; they are
    attended in a few padded groups, each multi-token row on its own.
    """
    needs = [rows[b].blocks_needed(block_size) for b in range(num_decode_rows)]
    lens, lens_offset = staging.alloc(num_decode_rows)
    for b in range(num_decode_rows):
        lens[b] = rows[b].num_computed_tokens + 1
    groups = []
    for first, end, width in decode_groups(needs, max_blocks):
        groups.append((first, end, width, stage_block_table(rows[first:end], width, block_size, staging)))
    prefills: list[tuple[BatchRow, int | None]] = []
    for row in rows[num_decode_rows:]:
        if row.num_computed_tokens == 0:  # attends only to its own new tokens: no table needed
            prefills.append((row, None))
            continue
        prefills.append((row, stage_block_table([row], row.blocks_needed(block_size), block_size, staging)))
    return StagedMetadata(groups, prefills, lens_offset)


def write_kv(kv: LayerKV, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the new tokens' K/V ([num_tokens, kv_heads, head_dim]) at their slots, and return them as
    the cache holds them, in their own dtype: rounded to its values where the cache's dtype is narrower
    (a 16-bit cache under a float32 model), so that a prompt's tokens attend to the same keys whether
    they come from this step or from the cache (chunked equal to unchunked, cached equal to uncached).
    On CPU with stepahead's kernels a 16-bit cache is written in one pass (kernels/kv_store.cpp) that
    rounds k and v in place; torch's operators otherwise."""
    nkv, hd = k.shape[1], k.shape[2]
    narrower = kv.k_cache.dtype in (torch.float16, torch.bfloat16) and k.dtype == torch.float32
    if narrower and k.device.type == "cpu" and cpu_build.available():
        cpu_ops.write_kv_rows(k, v, kv.k_cache, kv.v_cache, slot_mapping)  # k and v rounded in place
        return k, v
    stored_k, stored_v = k.to(kv.k_cache.dtype), v.to(kv.v_cache.dtype)
    if stored_k.dtype == torch.float16 and k.dtype != torch.float16:
        check_float16_range(stored_k, stored_v)
    kv.k_cache.view(nkv, -1, hd).index_copy_(1, slot_mapping, stored_k.transpose(0, 1))
    kv.v_cache.view(nkv, -1, hd).index_copy_(1, slot_mapping, stored_v.transpose(0, 1))
    return stored_k.to(k.dtype), stored_v.to(v.dtype)


def check_float16_range(k: torch.Tensor, v: torch.Tensor) -> None:
    """A value beyond float16's range becomes infinity in a float16 cache and attention's output NaN:
    fail the step loudly rather than let it sample from garbage."""
    if bool(torch.isinf(k).any() | torch.isinf(v).any()):
        raise RuntimeError("a key or value is beyond float16's range (65504), which the KV cache holds: "
                           "run with --kv-cache-dtype bfloat16 or float32")


def _gather(kv: LayerKV, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of the blocks in block_table ([rows, nb] or [nb]) as [kv_heads, rows, nb * block_size, head_dim]
    tensors of dtype (the queries')."""
    flat = block_table.reshape(-1)
    nkv, nb_total, _bs, hd = kv.k_cache.shape
    kbuf, vbuf = kv.scratch.get(nkv, flat.shape[0])
    torch.index_select(kv.k_cache.view(nkv, nb_total, -1), 1, flat, out=kbuf)
    torch.index_select(kv.v_cache.view(nkv, nb_total, -1), 1, flat, out=vbuf)
    rows = block_table.shape[0] if block_table.dim() == 2 else 1
    return kbuf.view(nkv, rows, -1, hd).to(dtype), vbuf.view(nkv, rows, -1, hd).to(dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV,
                    meta: AttentionMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q [T, heads, hd], k/v [T, kv_heads, hd] for the new tokens -> attention output [T, heads, hd].

    Writes the new K/V into the cache first, so every row reads its own new tokens from there too.
    window and softcap as attention.paged_attention takes them. Under a window a row gathers only the
    blocks its window's keys lie in (attention/windowed.py), the keys of them before the window
    masked; the kernel likewise starts at the window's first block.
    """
    k, v = write_kv(kv, k, v, meta.slot_mapping)
    num_tokens, num_heads, hd = q.shape
    nkv = k.shape[1]
    group = num_heads // nkv
    out = q.new_empty(q.shape)  # contiguous even when q is a view of the fused projection
    for g in meta.decode_groups:
        if meta.decode_kernel:
            cpu_ops.paged_decode_attention(q[g.start:g.end], kv.k_cache, kv.v_cache, g.block_table, g.seq_lens,
                                           scale, out[g.start:g.end], window, softcap)
            continue
        # Grouped-query trick: the `group` query heads that share a KV head become `group` query rows,
        # so no K/V repeat is needed. SDPA sees kv heads as its batch and rows as its heads.
        nd = g.end - g.start
        table, mask = g.block_table, g.mask
        if window is not None:
            # a width that depends on the group's (the row's own padded width) and the window alone
            width = min(table.shape[1], padded_blocks(windowed.window_blocks(window, kv.k_cache.shape[2])))
            keys = meta.windowed(g.start, window, windowed.decode_rows, g.block_table, g.seq_lens, window,
                                 kv.k_cache.shape[2], width)
            table, mask = keys.block_table, keys.mask
        kd, vd = _gather(kv, table, q.dtype)
        qd = q[g.start:g.end].view(nd, nkv, group, hd).transpose(0, 1)
        o = dense.attend(qd, kd, vd, mask, scale, softcap)
        out[g.start:g.end] = o.transpose(0, 1).reshape(nd, num_heads, hd)
    for first, count in _fresh_runs(meta.prefills):
        # prompts of the same length with nothing cached, side by side in the batch: one causal call
        start, n = first.start, first.end - first.start
        end = start + count * n
        qp, kp, vp = (x[start:end].view(count, n, -1, hd).transpose(1, 2) for x in (q, k, v))
        if window is None or window >= n:  # the window reaches every earlier new token: plain causal
            o = dense.attend(qp, kp, vp, None, scale, softcap, is_causal=True, enable_gqa=group > 1)
        else:
            keys = meta.windowed(start, window, windowed.fresh_rows, n, window, q.device)
            o = dense.attend(qp, kp, vp, keys.mask, scale, softcap, enable_gqa=group > 1)
        out[start:end] = o.transpose(1, 2).reshape(end - start, num_heads, hd)
    for row in meta.prefills:
        if row.block_table is not None:
            n = row.end - row.start
            qp = q[row.start:row.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
            table, mask, first_key = row.block_table, row.mask, 0
            if window is not None:
                keys = meta.windowed(row.start, window, windowed.prefix_row, row.block_table, row.context_len, n,
                                     window, kv.k_cache.shape[2])
                table, mask, first_key = keys.block_table, keys.mask, keys.first_key
            kc, vc = _gather(kv, table, q.dtype)
            total = row.context_len + n - first_key  # the keys from first_key on
            kp = kc[:, :, :total].transpose(0, 1)  # [1, kv_heads, total, hd]
            vp = vc[:, :, :total].transpose(0, 1)
            o = dense.attend(qp, kp, vp, mask, scale, softcap, enable_gqa=group > 1)
            out[row.start:row.end] = o[0].transpose(0, 1)
    return out


def _fresh_runs(prefills: list[PrefillRow]) -> list[tuple[PrefillRow, int]]:
    """(first row, count) for each run of consecutive rows without a cached prefix, of one length and
    adjacent in the batch: SDPA computes each (row, head) of a batch on its own, so one call over a run
    gives every row the bits it gets alone, and one call is faster than a call per row
    (docs/BENCHMARKS.md, section 14.4)."""
    runs: list[tuple[PrefillRow, int]] = []
    for row in prefills:
        if row.block_table is not None:
            continue
        if runs:
            first, count = runs[-1]
            n = first.end - first.start
            if row.end - row.start == n and row.start == first.start + count * n:
                runs[-1] = (first, count + 1)
                continue
        runs.append((row, 1))
    return runs


class SdpaBackend:
    """The CPU attention path behind the interface the model runner uses (stage, then finish).

    decode_kernel: every token runs stepahead's CPU kernel (the runner asks for it where the model runs
    stepahead's CPU kernels: float32 on CPU where they build, dense or packed weights)."""

    name = "sdpa"

    def __init__(self, block_size: int, max_blocks: int, arange: torch.Tensor, decode_kernel: bool = False) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks  # a sequence's most blocks
        self.arange = arange  # a device arange long enough for any row's keys
        self.decode_kernel = decode_kernel

    def stage(self, rows: list[BatchRow], num_decode_rows: int, staging) -> StagedMetadata | StagedKernelRows:
        if self.decode_kernel:
            return stage_kernel_rows(rows, staging, self.block_size)
        return stage_metadata(rows, num_decode_rows, staging, self.block_size, self.max_blocks)

    def finish(self, staged: StagedMetadata | StagedKernelRows, slot_mapping: torch.Tensor, staging) -> AttentionMetadata:
        return staged.finish(slot_mapping, staging, self.block_size, self.arange)
