"""BatchRow: one request's place in a step's flattened batch, as every attention path needs it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stepahead.utils import cdiv


@dataclass
class BatchRow:
    """One row (request) of a step's flattened batch, as attention sees it."""

    start: int  # index of its first new token in the flattened batch
    num_new_tokens: int
    num_computed_tokens: int  # tokens already in the KV cache before this step
    block_ids: list[int]  # the request's block table (covers at least its tokens after this step)

    def blocks_needed(self, block_size: int) -> int:
        return cdiv(self.num_computed_tokens + self.num_new_tokens, block_size)


def stage_block_table(rows: Sequence[BatchRow], width: int, block_size: int, staging) -> int:
    """Write the rows' block tables, padded to `width` with the null block 0, into the step's staging
    buffer as one [len(rows), width] table; returns its offset there."""
    table, offset = staging.alloc(len(rows) * width)
    table[:] = 0
    for b, row in enumerate(rows):
        need = row.blocks_needed(block_size)
        table[b * width:b * width + need] = row.block_ids[:need]
    return offset
