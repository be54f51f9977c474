"""BlockPool and KVCacheManager: block ids, ref counts, chained hashes, eviction order, caching frontier."""

from __future__ import annotations

import pytest

from stepahead.config import CacheConfig
from stepahead.core.block_pool import BlockPool
from stepahead.core.kv_cache import NONE_HASH, KVCacheManager, hash_block_tokens, update_block_hashes
from stepahead.request import Request
from stepahead.sampling_params import SamplingParams
from tests.core.harness import Harness


def _mgr(num_blocks=10, caching=True, block_size=4):
    return KVCacheManager(CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                      enable_prefix_caching=caching), max_model_len=256)


def _req(rid, prompt, salt=None):
    return Request(rid, prompt, SamplingParams(max_tokens=4), eos_token_id=2, cache_salt=salt)


def _admit(mgr, req):
    hits, n_hit = mgr.get_computed_blocks(req)
    blocks = mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hits)
    assert blocks is not None
    req.num_computed_tokens = req.num_tokens
    return hits, n_hit


def test_pool_null_block_and_free_queue():
    pool = BlockPool(6, enable_caching=True)
    assert pool.null_block.block_id == 0
    assert pool.free_block_queue.ids() == [1, 2, 3, 4, 5] and pool.get_num_free_blocks() == 5
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [1, 2] and all(b.ref_cnt == 1 for b in got)
    pool.touch([pool.blocks[4]])  # O(1) removal from the middle
    assert pool.free_block_queue.ids() == [3, 5]
    pool.register(got[1], block_hash=7)
    pool.free_blocks([pool.blocks[4], got[1], got[0]])
    # Unhashed blocks to the head (reused first), hashed ones to the tail, each in the given order.
    assert pool.free_block_queue.ids() == [4, 1, 3, 5, 2]
    pool.free_blocks([pool.null_block, pool.null_block])  # never freed, however often listed
    assert pool.get_num_free_blocks() == 5 and pool.null_block.ref_cnt == 0
    shared = pool.get_new_blocks(1)[0]
    pool.touch([shared])  # two holders
    pool.free_blocks([shared, pool.null_block, shared])  # listed twice in one call: queued once
    assert shared.ref_cnt == 0 and pool.free_block_queue.ids().count(shared.block_id) == 1
    assert pool.get_num_free_blocks() == 5
    with pytest.raises(ValueError):
        pool.get_new_blocks(6)


def test_chained_hashes_and_salt():
    req = _req("a", list(range(10)))
    hashes = update_block_hashes(req, 4)
    h0 = hash_block_tokens(None, (0, 1, 2, 3), None)
    h1 = hash_block_tokens(h0, (4, 5, 6, 7), None)
    assert hashes == [h0, h1]  # only full blocks
    assert hash_block_tokens(None, (0, 1, 2, 3), None) == hash((NONE_HASH, (0, 1, 2, 3), None))
    req.append_output_token_ids([10, 11])
    assert len(update_block_hashes(req, 4)) == 3  # grows as tokens are appended
    salted = update_block_hashes(_req("b", list(range(10)), salt="tenant"), 4)
    assert salted[0] != h0 and salted[1] != h1  # salt in block 0 reaches every later block by chaining


def test_allocate_returns_none_and_changes_nothing_when_short():
    mgr = _mgr(num_blocks=4)  # 3 usable
    a = _req("a", list(range(8)))
    _admit(mgr, a)
    b = _req("b", list(range(100, 108)))
    free = mgr.num_free_blocks
    assert mgr.allocate_slots(b, 8) is None
    assert mgr.num_free_blocks == free and "b" not in mgr.req_to_blocks


def test_prefix_hit_ref_counts_and_full_prompt_recompute():
    mgr = _mgr()
    a = _req("a", list(range(12)))
    _admit(mgr, a)
    assert mgr.get_block_ids("a") == [1, 2, 3]
    assert len(mgr.block_pool.cached_block_hash_to_block) == 3
    b = _req("b", list(range(12)) + [50, 51])
    hits, n_hit = _admit(mgr, b)
    assert n_hit == 12 and [x.block_id for x in hits] == [1, 2, 3]
    assert [x.ref_cnt for x in hits] == [2, 2, 2]
    c = _req("c", list(range(12)))  # the whole prompt is cached: recompute its last block
    hits, n_hit = _admit(mgr, c)
    assert n_hit == 8 and mgr.get_block_ids("c")[:2] == [1, 2] and mgr.get_block_ids("c")[2] not in (1, 2, 3)
    mgr.free(a)
    mgr.free(b)
    mgr.free(c)
    assert all(blk.ref_cnt == 0 for blk in mgr.block_pool.blocks[1:])


def test_eviction_order_reverse_free_and_lazy_eviction():
    mgr = _mgr(num_blocks=7)  # 6 usable
    a = _req("a", list(range(12)))
    _admit(mgr, a)  # blocks 1, 2, 3
    mgr.free(a)  # tail first: 3, 2, 1 appended after 4, 5, 6
    assert mgr.block_pool.free_block_queue.ids() == [4, 5, 6, 3, 2, 1]
    assert mgr.num_free_blocks == 6
    d = _req("d", list(range(200, 220)))  # 5 blocks: 4, 5, 6, then 3 and 2 are evicted
    h_before = set(mgr.block_pool.cached_block_hash_to_block)
    _admit(mgr, d)
    assert mgr.get_block_ids("d") == [4, 5, 6, 3, 2]
    assert len(h_before - set(mgr.block_pool.cached_block_hash_to_block)) == 2
    hits, n = mgr.get_computed_blocks(_req("a2", list(range(12))))
    assert n == 4 and [x.block_id for x in hits] == [1]  # the tail went first; the prefix head survives


def test_hits_touched_before_new_blocks_popped():
    """A request never evicts its own hit blocks, even when they sit at the head of the queue."""
    mgr = _mgr(num_blocks=5)  # 4 usable
    a = _req("a", list(range(8)))
    _admit(mgr, a)  # blocks 1, 2
    mgr.free(a)  # queue: 3, 4, 2, 1
    b = _req("b", list(range(8)) + list(range(40, 48)))  # hits 1, 2 (8 tokens), needs 2 more
    hits, n_hit = _admit(mgr, b)
    assert n_hit == 8 and mgr.get_block_ids("b") == [1, 2, 3, 4]


def test_evictable_hits_count_against_the_pool():
    mgr = _mgr(num_blocks=4)  # 3 usable
    a = _req("a", list(range(8)))
    _admit(mgr, a)
    mgr.free(a)
    b = _req("b", list(range(8)) + list(range(30, 38)))  # 2 free hits + 2 new > 3 free
    hits, n_hit = mgr.get_computed_blocks(b)
    assert n_hit == 8
    assert mgr.allocate_slots(b, 8, n_hit, hits) is None
    assert mgr.num_free_blocks == 3 and all(x.ref_cnt == 0 for x in hits)


def test_cache_blocks_idempotent_and_frontier():
    mgr = _mgr()
    a = _req("a", list(range(6)))
    _admit(mgr, a)
    assert len(mgr.block_pool.cached_block_hash_to_block) == 1  # only the full block
    a.append_output_token_ids([7, 8])
    mgr.cache_blocks(a, 8)
    mgr.cache_blocks(a, 8)
    mgr.cache_blocks(a, 5)
    assert len(mgr.block_pool.cached_block_hash_to_block) == 2 and mgr.num_cached_block["a"] == 2


def test_no_caching_registers_nothing():
    mgr = _mgr(caching=False)
    a = _req("a", list(range(12)))
    _admit(mgr, a)
    assert mgr.block_pool.cached_block_hash_to_block == {}
    assert mgr.get_computed_blocks(_req("b", list(range(12)))) == ([], 0)


def test_pop_blocks_for_free_keeps_references():
    mgr = _mgr()
    a = _req("a", list(range(8)))
    _admit(mgr, a)
    table = mgr.req_to_blocks["a"]  # a caller may still hold the request's block table
    free = mgr.num_free_blocks
    blocks = mgr.pop_blocks_for_free(a)
    assert [b.block_id for b in blocks] == [2, 1] and mgr.num_free_blocks == free
    assert [b.block_id for b in table] == [1, 2], "the block table itself is left as it was"
    assert "a" not in mgr.req_to_blocks
    mgr.block_pool.free_blocks(blocks)
    assert mgr.num_free_blocks == free + 2


def test_usage_and_reset():
    mgr = _mgr(num_blocks=5)
    a = _req("a", list(range(8)))
    _admit(mgr, a)
    assert mgr.usage == 0.5
    assert not mgr.reset_prefix_cache()
    mgr.free(a)
    assert mgr.reset_prefix_cache() and mgr.block_pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in mgr.block_pool.blocks)


def _first_step_with_block_cached(is_async: bool) -> int:
    """Schedule id at which r's second block (filled by decoded tokens) enters the prefix cache."""
    h = Harness(is_async=is_async, depth=2 if is_async else 1, block_size=4)
    r = h.add("r", [1, 2, 3, 4, 5, 6], max_tokens=6)
    pool = h.sched.kv_cache_manager.block_pool
    while True:
        h.step()
        blocks = h.sched.kv_cache_manager.get_blocks("r")
        if len(blocks) > 1 and blocks[1].block_hash is not None:
            assert r.num_tokens >= 8
            return h.sched.current_step
        assert pool is not None


def test_async_registers_decode_filled_blocks_one_step_later():
    assert _first_step_with_block_cached(False) == 3  # tokens 7, 8 known after step 2
    assert _first_step_with_block_cached(True) == 4


def test_prefix_cached_equals_uncached():
    outs = {}
    for caching in (False, True):
        h = Harness(caching=caching, block_size=4)
        prompt = list(range(40, 53))
        for i in range(3):
            h.add(f"r{i}", prompt + [i], max_tokens=5)
        h.run()
        outs[caching] = dict(h.delivered)
        if caching:
            assert h.sched.kv_cache_manager.prefix_cache_hits > 0
    assert outs[True] == outs[False]


def test_three_block_pool_keeps_the_longer_cached_prefix():
    """Unhashed freed blocks are reused first, so a cached 8-token prefix survives a short request."""
    mgr = KVCacheManager(CacheConfig(block_size=4, num_blocks=4), max_model_len=64)  # 3 usable blocks
    a = _req("a", list(range(100, 108)))  # blocks 1, 2: both full and cached
    assert mgr.allocate_slots(a, 8) is not None
    a.num_computed_tokens = 8
    mgr.free(a)  # queue: 3, 2, 1
    c = _req("c", [7, 8, 9])  # takes block 3, which never fills: no hash
    assert mgr.allocate_slots(c, 3) is not None and mgr.get_block_ids("c") == [3]
    mgr.free(c)  # old rule: to the tail (2, 1, 3); now to the head (3, 2, 1)
    assert mgr.block_pool.free_block_queue.ids() == [3, 2, 1]
    d = _req("d", [40, 41, 42])
    assert mgr.allocate_slots(d, 3) is not None and mgr.get_block_ids("d") == [3]
    _, num_hit = mgr.get_computed_blocks(_req("a2", list(range(100, 108)) + [1]))
    assert num_hit == 8  # appending every freed block to the tail would have evicted block 2: 4
