"""Paged KV cache and attention over it for a mixed prefill + decode batch (torch SDPA, CPU and CUDA).

Layout: one K and one V tensor per layer, shaped [num_kv_heads, num_blocks, block_size, head_dim]
(head-major), so a request's context is gathered block-wise with one `index_select(out=...)` into a
reusable buffer, and the gathered [kv_heads, rows, tokens, head_dim] tensor feeds SDPA with every
(head, row) slab contiguous (measured faster than token-major for both the gather and SDPA on CPU).

The flattened batch is ordered by the model runner as: single-token rows first (decodes, and one-token
prefill chunks) sorted by context length, then multi-token rows. Single-token rows are attended in a few
padded SDPA calls (groups of similar length); each multi-token row gets its own call (there are few per
step), causal within its new tokens and full over its cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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
    """Single-token rows [start, end) of the flattened batch, attended in one padded SDPA call.

    The runner sorts these rows by context length and splits them so padding stays bounded."""

    start: int
    end: int
    block_table: torch.Tensor  # [rows, max_blocks] long (padding points at null block 0)
    mask: torch.Tensor  # [1, rows, 1, max_blocks * block_size] bool: key is valid


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built by the model runner, passed down explicitly."""

    slot_mapping: torch.Tensor  # [num_tokens] long: flat slot (block * block_size + offset) of each new token
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillRow] = field(default_factory=list)


class KVGatherBuffer:
    """Reusable scratch for gathered K/V; grows when a step needs more, never shrinks (no per-step alloc)."""

    def __init__(self, block_elems: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.block_elems = block_elems
        self.dtype = dtype
        self.device = device
        self.k = torch.empty(0, dtype=dtype, device=device)
        self.v = torch.empty(0, dtype=dtype, device=device)

    def get(self, num_kv_heads: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [num_kv_heads, num_blocks, block_elems] views of the scratch memory."""
        need = num_kv_heads * num_blocks * self.block_elems
        if self.k.numel() < need:
            cap = max(need, 2 * self.k.numel())
            self.k = torch.empty(cap, dtype=self.dtype, device=self.device)
            self.v = torch.empty(cap, dtype=self.dtype, device=self.device)
        shape = (num_kv_heads, num_blocks, self.block_elems)
        return self.k[:need].view(shape), self.v[:need].view(shape)


class PagedKVCache:
    """The KV tensors of every layer plus the gather scratch they share."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.scratch = KVGatherBuffer(block_size * head_dim, dtype, device)
        self.layers = [LayerKV(k, v, self.scratch) for k, v in zip(self.k, self.v, strict=True)]

    def layer(self, i: int) -> LayerKV:
        return self.layers[i]


@dataclass
class LayerKV:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scratch: KVGatherBuffer


def write_kv(kv: LayerKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([num_tokens, kv_heads, head_dim]) at their slots."""
    nkv, hd = k.shape[1], k.shape[2]
    kv.k_cache.view(nkv, -1, hd).index_copy_(1, slot_mapping, k.transpose(0, 1))
    kv.v_cache.view(nkv, -1, hd).index_copy_(1, slot_mapping, v.transpose(0, 1))


def _gather(kv: LayerKV, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of the blocks in block_table ([rows, nb] or [nb]) as [kv_heads, rows, nb * block_size, head_dim]."""
    flat = block_table.reshape(-1)
    nkv, nb_total, _bs, hd = kv.k_cache.shape
    kbuf, vbuf = kv.scratch.get(nkv, flat.shape[0])
    torch.index_select(kv.k_cache.view(nkv, nb_total, -1), 1, flat, out=kbuf)
    torch.index_select(kv.v_cache.view(nkv, nb_total, -1), 1, flat, out=vbuf)
    rows = block_table.shape[0] if block_table.dim() == 2 else 1
    return kbuf.view(nkv, rows, -1, hd), vbuf.view(nkv, rows, -1, hd)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, hd], k/v [T, kv_heads, hd] for the new tokens -> attention output [T, heads, hd].

    Writes the new K/V into the cache first, so every row reads its own new tokens from there too.
    """
    write_kv(kv, k, v, meta.slot_mapping)
    num_tokens, num_heads, hd = q.shape
    nkv = k.shape[1]
    group = num_heads // nkv
    out = torch.empty_like(q)
    for g in meta.decode_groups:
        # Grouped-query trick: the `group` query heads that share a KV head become `group` query rows,
        # so no K/V repeat is needed. SDPA sees kv heads as its batch and rows as its heads.
        nd = g.end - g.start
        kd, vd = _gather(kv, g.block_table)
        qd = q[g.start:g.end].view(nd, nkv, group, hd).transpose(0, 1)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale)
        out[g.start:g.end] = o.transpose(0, 1).reshape(nd, num_heads, hd)
    for row in meta.prefills:
        n = row.end - row.start
        qp = q[row.start:row.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
        if row.block_table is None:
            kp = k[row.start:row.end].transpose(0, 1).unsqueeze(0)
            vp = v[row.start:row.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            kc, vc = _gather(kv, row.block_table)
            total = row.context_len + n
            kp = kc[:, :, :total].transpose(0, 1)  # [1, kv_heads, total, hd]
            vp = vc[:, :, :total].transpose(0, 1)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=row.mask, scale=scale, enable_gqa=group > 1)
        out[row.start:row.end] = o[0].transpose(0, 1)
    return out
