"""The blocks and mask a row reads under a sliding window on the SDPA path: only the blocks that hold
keys of its window (the engine may have handed the earlier ones to other requests), and which of
their keys each query sees."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stepahead.attention import dense
from stepahead.utils import cdiv


@dataclass
class WindowedKeys:
    block_table: torch.Tensor  # the blocks to gather (empty: the rows read no cached block)
    mask: torch.Tensor  # which gathered (or new) keys each query sees
    first_key: int = 0  # position of the first gathered key (a prefix row's; decode rows carry theirs in the mask)


def window_blocks(window: int, block_size: int) -> int:
    """The most blocks a window's keys touch: window keys from any offset in a block."""
    return cdiv(window - 1, block_size) + 1


def decode_rows(block_table: torch.Tensor, seq_lens: torch.Tensor, window: int, block_size: int,
                width: int) -> WindowedKeys:
    """Decode rows (one query each, the last of seq_lens keys): each row's table from its window's
    first block, `width` blocks (padding past its last block points where its table does and is
    masked), and the [1, rows, 1, width * block_size] mask of its window's keys."""
    rows = block_table.shape[0]
    first = (seq_lens - window).clamp(min=0) // block_size  # [rows]: the window's first block
    steps = torch.arange(width, device=block_table.device)
    columns = (first.unsqueeze(1) + steps).clamp(max=block_table.shape[1] - 1)
    table = block_table.gather(1, columns)
    keys = first.unsqueeze(1) * block_size + torch.arange(width * block_size, device=block_table.device)
    last = (seq_lens - 1).unsqueeze(1)
    mask = (keys <= last) & (keys > last - window)
    return WindowedKeys(table, mask.view(1, rows, 1, width * block_size))


def fresh_rows(num_new: int, window: int, device) -> WindowedKeys:
    """Prompts with nothing cached: the [num_new, num_new] mask of each new token's window among them."""
    no_blocks = torch.empty(0, dtype=torch.long, device=device)
    return WindowedKeys(no_blocks, dense.visible_keys(torch.arange(num_new, device=device), num_new, window))


def prefix_row(block_table: torch.Tensor, context_len: int, num_new: int, window: int,
               block_size: int) -> WindowedKeys:
    """A prompt chunk after context_len cached tokens: its table from the first block its first
    query's window touches, and the [1, 1, num_new, keys] mask over the keys from there."""
    first_key = max(0, context_len - window + 1) // block_size * block_size
    positions = torch.arange(context_len, context_len + num_new, device=block_table.device)
    mask = dense.visible_keys(positions - first_key, context_len + num_new - first_key, window)
    return WindowedKeys(block_table[first_key // block_size:], mask.view(1, 1, num_new, -1), first_key)
