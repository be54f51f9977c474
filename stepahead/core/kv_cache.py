"""KVCacheManager: per-request block tables over a BlockPool, with chained-hash prefix caching.

A prefix lookup is capped at num_tokens - 1 (one token is always recomputed so logits exist), hit
blocks are touched before new blocks are popped (a request never evicts its own hits), an
allocation that does not fit returns None and changes nothing (but for the out-of-window blocks it
returns first), and a request's blocks are freed in reverse order so its tail is evicted first.
With a sliding window on every layer (CacheConfig.sliding_window), blocks that fall out of the
window go back to the pool as the request advances and prefix hits need only the window
(core/sliding_window.py).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

from stepahead.config import CacheConfig
from stepahead.core.block_pool import BlockPool, KVCacheBlock
from stepahead.core.sliding_window import find_window_cache_hit, num_skipped_blocks
from stepahead.request import Request
from stepahead.utils import cdiv


def _none_hash() -> int:
    """Parent hash of block 0: random per process, or reproducible under PYTHONHASHSEED."""
    seed = os.environ.get("PYTHONHASHSEED")
    raw = seed.encode() if seed not in (None, "random") else os.urandom(32)
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "little")


NONE_HASH = _none_hash()
_NO_BLOCKS: tuple[KVCacheBlock, ...] = ()


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...], extra_keys: tuple | None) -> int:
    """Chained block hash: the parent's hash, this block's tokens, and extra keys (cache salt)."""
    return hash((NONE_HASH if parent_hash is None else parent_hash, token_ids, extra_keys))


def block_extra_keys(request: Request, block_index: int) -> tuple | None:
    # cache_salt isolates tenants: it enters block 0 only, and chaining carries it to the rest.
    if block_index == 0 and request.cache_salt is not None:
        return (request.cache_salt,)
    return None


def update_block_hashes(request: Request, block_size: int) -> list[int]:
    """Extend request.block_hashes to cover every full block of all_token_ids (incremental)."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full = len(tokens) // block_size
    i = len(hashes)
    while i < num_full:
        parent = hashes[i - 1] if i > 0 else None
        block_tokens = tuple(tokens[i * block_size:(i + 1) * block_size])
        hashes.append(hash_block_tokens(parent, block_tokens, block_extra_keys(request, i)))
        i += 1
    return hashes


class KVCacheManager:
    """Owns the block pool and every request's block table; the scheduler asks it for room.

    Guarantees: an allocation either fits entirely or changes nothing (returns None); only full
    blocks of real tokens are hashed into the prefix cache, because callers pass a token count that
    excludes placeholders (docs/design.md, "The cacheable frontier"); a freed request's blocks go
    back tail first, so the blocks least likely to be shared are evicted first. With a sliding
    window, a block table holds the null block where blocks fell out of the window, always as a
    prefix of the table (docs/design.md, "Sliding-window blocks").
    """

    def __init__(self, cache_config: CacheConfig, max_model_len: int) -> None:
        self.block_size = cache_config.block_size
        self.enable_caching = cache_config.enable_prefix_caching
        self.max_model_len = max_model_len
        self.sliding_window = cache_config.sliding_window
        self.block_pool = BlockPool(cache_config.num_blocks, self.enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}  # full blocks already registered, per request
        # Prefix-cache statistics, in tokens, counted once per admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_window_freed_blocks = 0  # blocks returned as they fell out of the sliding window

    # -- pool views ----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue (reusable, possibly still cached); the null block excluded."""
        return self.block_pool.get_num_free_blocks()

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # -- prefix cache --------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks, capped at num_tokens - 1 tokens. With a
        sliding window only the blocks in the window before the hit point must be cached; the list
        holds the null block for the earlier ones. None for a request that asked for prompt logprobs:
        a hit would skip positions it wants logprobs of."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = update_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        get = self.block_pool.get_cached_block
        if self.sliding_window is not None:
            window_hits = find_window_cache_hit(hashes, max_blocks, self.sliding_window, self.block_size, get,
                                                self.block_pool.null_block)
            return window_hits, len(window_hits) * self.block_size
        hits: list[KVCacheBlock] = []
        for i in range(min(max_blocks, len(hashes))):
            block = get(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the full blocks covering the first num_tokens tokens; idempotent."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_block.get(rid, 0)
        if num_full <= num_cached:
            return
        hashes = update_block_hashes(request, self.block_size)
        blocks = self.req_to_blocks[rid]
        num_full = min(num_full, len(hashes), len(blocks))
        register = self.block_pool.register
        null_block = self.block_pool.null_block
        for i in range(num_cached, num_full):
            block = blocks[i]
            # Hit blocks are registered already; a block out of the window is gone from the table.
            if block.block_hash is None and block is not null_block:
                register(block, hashes[i])
        self.num_cached_block[rid] = max(num_cached, num_full)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # -- allocation ----------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> Sequence[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens; returns the newly popped blocks, or None.

        None means the pool is short, and then nothing has changed but the out-of-window blocks
        returned first (sliding window). Hit blocks (new_computed_blocks) are touched before new
        blocks are popped.
        """
        rid = request.request_id
        hits = new_computed_blocks or ()
        total_computed = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len)
        if self.sliding_window is not None:
            # Before counting free blocks: what falls out of the window may serve this allocation.
            self.remove_skipped_blocks(request, total_computed - request.num_in_flight_tokens)
        need_slots = min(total_computed + num_new_tokens, self.max_model_len)
        held = self.req_to_blocks.get(rid)
        num_held = len(held) if held is not None else 0
        num_new_blocks = max(cdiv(need_slots, self.block_size) - num_held - len(hits), 0)
        if not num_new_blocks and not hits:  # the decode fast path: the last block has room
            if self.enable_caching:
                self.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
            return _NO_BLOCKS
        # Free hit blocks leave the free pool when touched, so they count against it too.
        null_block = self.block_pool.null_block
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0 and b is not null_block)
        if num_new_blocks + num_evictable_hits > self.block_pool.get_num_free_blocks():
            return None
        if held is None:
            held = self.req_to_blocks[rid] = []
        if hits:
            self.block_pool.touch(hits)
            held.extend(hits)
            if self.enable_caching:
                self.num_cached_block[rid] = max(self.num_cached_block.get(rid, 0), len(held))
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        if new_blocks:
            held.extend(new_blocks)
        if self.enable_caching:
            # Placeholders and unverified tokens are not in num_tokens, so they are never cached.
            self.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    # -- freeing -------------------------------------------------------------------------------

    def remove_skipped_blocks(self, request: Request, num_processed_tokens: int) -> None:
        """Return the blocks wholly before the window of the request's next token to process; the null
        block takes their place. Tail first, as any free; the nulls stay a prefix of the table."""
        assert self.sliding_window is not None
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_skipped = min(num_skipped_blocks(num_processed_tokens, self.sliding_window, self.block_size),
                          len(blocks))
        null_block = self.block_pool.null_block
        removed: list[KVCacheBlock] = []
        for i in range(num_skipped - 1, -1, -1):
            if blocks[i] is null_block:
                break  # an earlier call (or the prefix hit) nulled everything before it
            removed.append(blocks[i])
            blocks[i] = null_block
        if removed:
            self.block_pool.free_blocks(removed)
            self.num_window_freed_blocks += len(removed)

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first, so its last blocks are evicted first."""
        blocks = self.pop_blocks_for_free(request)
        if blocks:
            self.block_pool.free_blocks(blocks)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Drop the request's bookkeeping now; return its blocks, tail first, still referenced.

        The result is a new list: a caller may still hold the request's block table.
        """
        rid = request.request_id
        self.num_cached_block.pop(rid, None)
        blocks = self.req_to_blocks.pop(rid, None)
        if not blocks:
            return []
        return blocks[::-1]
