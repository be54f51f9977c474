"""Sliding-window KV blocks: which blocks a request no longer needs, and prefix hits that need only the window.

With a window of w tokens, the token at position p attends to positions p - w + 1 .. p. A block
whose every position lies before that range for the next token is never read again, so the KV
cache manager returns it to the pool and puts the null block in its place in the block table (the
table keeps its length: positions still index it). For the same reason a prefix hit needs only the
blocks inside the window before the hit point; earlier ones are the null block (vLLM's
SlidingWindowManager).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from stepahead.core.block_pool import KVCacheBlock
from stepahead.utils import cdiv


def num_skipped_blocks(num_processed_tokens: int, window: int, block_size: int) -> int:
    """Blocks wholly before the window of the next token to process (position num_processed_tokens).

    Counted from the processed tokens (num_computed_tokens - num_in_flight_tokens), not the computed
    ones: a step in flight reads the window of its own positions, which starts earlier (I6).
    """
    first_needed = num_processed_tokens - window + 1
    return first_needed // block_size if first_needed > 0 else 0


def num_window_blocks(window: int, block_size: int) -> int:
    """Consecutive cached blocks a hit needs before its hit point: the window - 1 tokens the next token
    reads besides itself (at least one block, so a hit always holds a cached block)."""
    return max(1, cdiv(window - 1, block_size))


def find_window_cache_hit(
    block_hashes: Sequence[int],
    max_num_blocks: int,
    window: int,
    block_size: int,
    get_cached: Callable[[int], KVCacheBlock | None],
    null_block: KVCacheBlock,
) -> list[KVCacheBlock]:
    """The longest hit of at most max_num_blocks blocks: cached blocks covering the window before the
    hit point, the null block before them. Scanned from the right, so the first long enough run of
    cached blocks gives the longest hit. A shorter run that starts at block 0 is a hit too (the
    window then reaches the start of the sequence)."""
    needed = num_window_blocks(window, block_size)
    num_blocks = min(max_num_blocks, len(block_hashes))
    hits = [null_block] * num_blocks
    run = 0
    for i in range(num_blocks - 1, -1, -1):
        block = get_cached(block_hashes[i])
        if block is None:
            run = 0
            continue
        hits[i] = block
        run += 1
        if run >= needed:
            return hits[:i + run]
    return hits[:run]
