"""The CUDA attention path: the Triton kernels read block tables directly, one launch per layer for the
whole mixed batch (decode rows, prefills, chunked prefills with a cached prefix), no KV gather.

Metadata is four small integer tensors (the block table, each row's context length including its new
tokens, the cumulative new-token counts, the slot of every new token) plus the longest row's new-token
count, which picks the decode-specialised launch when every row has one token. The same metadata built
over fixed device buffers is what a CUDA graph captures (worker/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stepahead.attention.paged_cache import LayerKV
from stepahead.attention.rows import BatchRow, stage_block_table


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat KV slot of every new token (-1: padding, skipped)
    block_table: torch.Tensor  # [num_rows, width]: each row's blocks, padded with the null block 0
    seq_lens: torch.Tensor  # [num_rows]: context length after this step (0: a padding row)
    query_start_loc: torch.Tensor  # [num_rows + 1]: first new token of each row in the flattened batch
    max_query_len: int  # host-known: 1 selects the decode launch
    num_decode_rows: int = 0  # leading rows with one new token: a mixed step attends them with the decode launch

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, scale: float,
               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        from stepahead.attention import triton_paged

        triton_paged.write_kv(k, v, kv.k_cache, kv.v_cache, self.slot_mapping)
        out = q.new_empty(q.shape)  # contiguous even when q is a view of the fused projection
        triton_paged.paged_attention(q, kv.k_cache, kv.v_cache, self.block_table, self.seq_lens,
                                     self.query_start_loc, max_query_len=self.max_query_len, scale=scale, out=out,
                                     num_decode_rows=self.num_decode_rows, window=window, softcap=softcap)
        return out


@dataclass
class StagedTritonMetadata:
    """Offsets of the metadata in the step's staging buffer, turned into device views after the upload."""

    num_rows: int
    width: int
    table_offset: int
    lens_offset: int
    starts_offset: int
    max_query_len: int
    num_decode_rows: int

    def finish(self, slot_mapping: torch.Tensor, staging) -> TritonMetadata:
        rows = self.num_rows
        return TritonMetadata(slot_mapping, staging.view(self.table_offset, rows * self.width, (rows, self.width)),
                              staging.view(self.lens_offset, rows), staging.view(self.starts_offset, rows + 1),
                              self.max_query_len, self.num_decode_rows)


class TritonBackend:
    name = "triton"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def stage(self, rows: list[BatchRow], num_decode_rows: int, staging) -> StagedTritonMetadata:
        """Write the block table, context lengths and row starts into the staging buffer (host side)."""
        width = max((row.blocks_needed(self.block_size) for row in rows), default=1)
        table_offset = stage_block_table(rows, width, self.block_size, staging)
        lens, lens_offset = staging.alloc(len(rows))
        starts, starts_offset = staging.alloc(len(rows) + 1)
        for b, row in enumerate(rows):
            lens[b] = row.num_computed_tokens + row.num_new_tokens
            starts[b] = row.start
        starts[len(rows)] = rows[-1].start + rows[-1].num_new_tokens if rows else 0
        max_query_len = max((row.num_new_tokens for row in rows), default=0)
        return StagedTritonMetadata(len(rows), width, table_offset, lens_offset, starts_offset, max_query_len,
                                    num_decode_rows)

    def finish(self, staged: StagedTritonMetadata, slot_mapping: torch.Tensor, staging) -> TritonMetadata:
        return staged.finish(slot_mapping, staging)
