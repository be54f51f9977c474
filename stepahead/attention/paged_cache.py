"""The paged KV tensors of every layer.

Layout: one K and one V tensor per layer, shaped [num_kv_heads, num_blocks, block_size, head_dim]
(head-major): the SDPA path gathers a request's context block-wise with one index_select per tensor, and
the Triton kernels read any layout through strides.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch


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
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.scratch = KVGatherBuffer(block_size * head_dim, dtype, device)
        self.layers = [LayerKV(k, v, self.scratch) for k, v in zip(self.k, self.v, strict=True)]

    def layer(self, i: int) -> LayerKV:
        return self.layers[i]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor. On CPU it lives in anonymous mmap memory, which the OS hands out zero-filled page
    by page as it is first written, so a pool of gigabytes costs nothing until it fills (torch.zeros
    would write every page at start: over a second for the default 2 GiB). Zeros matter: the SDPA path
    reads never-written slots under a mask, and 0 * NaN garbage would be NaN."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


@dataclass
class LayerKV:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scratch: KVGatherBuffer
