"""A step's attention through the CPU backend's real staging and metadata path, for the tests."""

from __future__ import annotations

import torch

from stepahead.attention.rows import BatchRow
from stepahead.attention.sdpa import SdpaBackend, paged_attention
from stepahead.worker.staging import StagingBuffer

MAX_BLOCKS = 128


def attend_staged(q, k, v, cache, rows: list[BatchRow], decode_kernel: bool, block_size: int, scale: float,
                  window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of a step whose rows are `rows` (single-token rows first), layer 0 of cache."""
    staging = StagingBuffer(8192, torch.device("cpu"))
    backend = SdpaBackend(block_size, MAX_BLOCKS, torch.arange(MAX_BLOCKS * block_size + 64), decode_kernel)
    staged = backend.stage(rows, sum(row.num_new_tokens == 1 for row in rows), staging)
    slots, offset = staging.alloc(q.shape[0])
    for row in rows:
        for i in range(row.num_new_tokens):
            pos = row.num_computed_tokens + i
            slots[row.start + i] = row.block_ids[pos // block_size] * block_size + pos % block_size
    meta = backend.finish(staged, staging.view(offset, q.shape[0]), staging)
    assert meta.decode_kernel == decode_kernel
    return paged_attention(q, k, v, cache.layer(0), meta, scale, window, softcap)
