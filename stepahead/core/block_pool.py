"""The paged KV block pool: free queue, ref counts and the prefix-cache hash map.

Block 0 is the null block: taken out of the free queue at init and never handed out or freed; a
sliding-window block table holds it (possibly many times) where blocks fell out of the window.
A block whose ref count drops to 0 keeps its hash, so it can still be hit, and goes to the tail of
the free queue; it is evicted lazily, when it reaches the head and is popped for reuse. A freed
block without a hash can never be hit, so it goes to the head instead and is reused first: cached
prefixes then survive longer under memory pressure (vLLM's current rule).
"""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # set only while registered in the prefix cache
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels: O(1) pop head, append tail, remove middle."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def prepend_all(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the head, in the given order (the first is popped first)."""
        for block in reversed(blocks):
            first = self.head.next_free
            assert first is not None
            block.prev_free = self.head
            block.next_free = first
            first.prev_free = block
            self.head.next_free = block
            self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def ids(self) -> list[int]:
        """Block ids from head (next to be reused) to tail; for tests and invariant checks."""
        out = []
        node = self.head.next_free
        while node is not None and node is not self.tail:
            out.append(node.block_id)
            node = node.next_free
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # hash -> {block_id: block}; duplicates allowed (block tables stay append-only).
        self.cached_block_hash_to_block: dict[int, dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        assert self.null_block.block_id == 0

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        entry = self.cached_block_hash_to_block.get(block_hash)
        if not entry:
            return None
        return next(iter(entry.values()))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks, only {self.free_block_queue.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        entry = self.cached_block_hash_to_block.get(block.block_hash)  # type: ignore[arg-type]
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del self.cached_block_hash_to_block[block.block_hash]  # type: ignore[arg-type]
        block.block_hash = None

    def register(self, block: KVCacheBlock, block_hash: int) -> None:
        block.block_hash = block_hash
        entry = self.cached_block_hash_to_block.get(block_hash)
        if entry is None:
            self.cached_block_hash_to_block[block_hash] = {block.block_id: block}
        else:
            entry[block.block_id] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference; a free (ref 0) block leaves the middle of the free queue. The null block
        (a sliding-window hit's skipped blocks) is not counted."""
        queue = self.free_block_queue
        null_block = self.null_block
        for block in blocks:
            if block is null_block:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per listing, most evictable first. Of the blocks reaching 0, those
        without a hash go to the head in that order, hashed ones to the tail in that order. The null
        block is skipped however often it is listed; a shared block listed twice loses two references."""
        null_block = self.null_block
        released: list[KVCacheBlock] = []
        for block in ordered:
            if block is null_block:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                released.append(block)
        if not released:
            return
        queue = self.free_block_queue
        unhashed = [b for b in released if b.block_hash is None]
        if unhashed:
            queue.prepend_all(unhashed)
        if len(unhashed) < len(released):
            for block in released:
                if block.block_hash is not None:
                    queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only possible when no request holds a block."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.block_hash = None
        return True
