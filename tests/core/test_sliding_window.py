"""Sliding-window KV management: blocks out of the window go back to the pool, on the processed basis;
prefix hits need only the window; a model with a global layer frees nothing."""

from __future__ import annotations

import pytest

from stepahead.config import CacheConfig, ModelConfig
from stepahead.core.block_pool import BlockPool
from stepahead.core.kv_cache import KVCacheManager, update_block_hashes
from stepahead.core.sliding_window import find_window_cache_hit, num_skipped_blocks
from stepahead.request import Request
from stepahead.sampling_params import SamplingParams
from tests.core.harness import Harness


def _mgr(window, num_blocks=16, block_size=4, caching=True):
    return KVCacheManager(CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching,
                                      sliding_window=window), max_model_len=256)


def _req(rid, prompt, max_tokens=4):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=2)


@pytest.mark.parametrize("processed,window,block_size,skipped", [
    (0, 4, 2, 0), (3, 4, 2, 0), (4, 4, 2, 0), (5, 4, 2, 1), (6, 4, 2, 1), (7, 4, 2, 2),
    (12, 5, 4, 2), (11, 5, 4, 1), (9, 1, 4, 2), (100, 200, 4, 0),
])
def test_blocks_wholly_before_the_next_tokens_window(processed, window, block_size, skipped):
    # Position `processed` reads processed - window + 1 .. processed; only blocks wholly before go.
    assert num_skipped_blocks(processed, window, block_size) == skipped


def test_window_hit_needs_only_the_blocks_in_the_window():
    """block_size 2, window 5: the next token reads the 4 tokens before the hit point, 2 blocks."""
    pool = BlockPool(16, enable_caching=True)
    null = pool.null_block
    blocks = pool.blocks

    def hit(cached: dict[int, int], max_blocks: int) -> list[int]:
        got = find_window_cache_hit(list(range(max_blocks)), max_blocks, 5, 2,
                                    lambda h: blocks[cached[h]] if h in cached else None, null)
        return [b.block_id for b in got]

    assert hit({}, 6) == []
    assert hit({0: 3}, 6) == [3]  # a short run from block 0 is a hit: the window reaches the start
    assert hit({1: 4}, 6) == []  # one block before a gap is not the whole window
    assert hit({2: 5, 3: 6}, 6) == [0, 0, 5, 6]  # blocks 0 and 1 are out of the window: null
    assert hit({0: 3, 2: 5, 3: 6, 5: 8}, 6) == [0, 0, 5, 6]  # block 5 alone is no window
    assert hit({0: 3, 1: 4, 2: 5, 3: 6, 4: 7, 5: 8}, 6) == [0, 0, 0, 0, 7, 8]  # the longest hit
    assert hit({0: 3, 1: 4, 2: 5, 3: 6, 4: 7, 5: 8}, 3) == [0, 4, 5]  # capped at max_blocks


def test_running_request_returns_blocks_as_they_leave_the_window():
    mgr = _mgr(window=6, num_blocks=8)  # 7 usable blocks of 4
    req = _req("a", list(range(100, 110)), max_tokens=40)  # 10 prompt tokens: 3 blocks
    assert mgr.allocate_slots(req, 10) is not None
    req.num_computed_tokens = 10
    tables = []
    for j in range(14):  # decode: one token per step, processed at once (nothing in flight)
        req.append_output_token_ids([500 + j])
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        tables.append(mgr.get_block_ids("a"))
    # Position p reads p - 5 .. p: at p = 23 (the last step) blocks 0..3 (positions 0..15) are out,
    # one at a time as p reached 9 (before the first step), 13, 17 and 21.
    assert [t.count(0) for t in tables] == [1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4]
    assert tables[-1][:4] == [0, 0, 0, 0] and 0 not in tables[-1][4:]
    assert len(tables[-1]) == 6  # the table keeps its length: positions still index it
    assert mgr.num_window_freed_blocks == 4 and mgr.num_free_blocks == 7 - 2
    # The freed blocks were full and hashed: they wait at the tail, still prefix hits.
    assert all(mgr.block_pool.blocks[i].block_hash is not None for i in (1, 2, 3, 4))
    mgr.free(req)  # the table's nulls are skipped however many there are
    assert mgr.num_free_blocks == mgr.num_usable_blocks


def test_pruning_waits_for_the_steps_in_flight():
    """Measured on num_computed - num_in_flight: a step in flight reads the window of its own positions."""
    mgr = _mgr(window=4, block_size=2)
    req = _req("a", list(range(100, 110)), max_tokens=20)
    assert mgr.allocate_slots(req, 10) is not None
    req.num_computed_tokens = 10
    req.num_in_flight_tokens = 4  # positions 6..9 still in flight
    req.append_output_token_ids([7])
    mgr.allocate_slots(req, 1)
    # Processed 6: position 6 reads 3..6, so only block 0 (positions 0, 1) is out.
    ids = mgr.get_block_ids("a")
    assert ids[0] == 0 and 0 not in ids[1:]
    req.num_in_flight_tokens = 0  # processed 10: position 10 reads 7..10, blocks 0..2 are out
    mgr.allocate_slots(req, 1)
    assert mgr.get_block_ids("a")[:4].count(0) == 3 and mgr.num_window_freed_blocks == 3


def test_prefix_hit_skips_blocks_before_the_window():
    mgr = _mgr(window=5)  # block_size 4: a hit needs the one block before its hit point
    a = _req("a", list(range(100, 113)))
    assert mgr.allocate_slots(a, 13) is not None  # blocks 1, 2, 3 full and cached
    a.num_computed_tokens = 13
    mgr.free(a)
    b = _req("b", list(range(100, 112)) + list(range(60, 65)))  # 17 tokens: 3 cached blocks, then new
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 12 and [h.block_id for h in hits] == [0, 0, 3]
    free = mgr.num_free_blocks
    assert mgr.allocate_slots(b, 5, num_hit, hits) is not None
    # Only block 3 was touched; blocks 1, 2 stay free (and cached); the null block is never counted.
    assert mgr.block_pool.blocks[3].ref_cnt == 1 and mgr.block_pool.blocks[1].ref_cnt == 0
    assert mgr.num_free_blocks == free - 1 - 2 and mgr.block_pool.null_block.ref_cnt == 0
    assert mgr.get_block_ids("b")[:3] == [0, 0, 3]


def test_null_blocks_are_never_cached():
    """A block that left the window before it filled is not registered (its slot holds the null block)."""
    mgr = _mgr(window=2, block_size=2)
    req = _req("a", list(range(100, 103)), max_tokens=10)
    assert mgr.allocate_slots(req, 3) is not None
    req.num_computed_tokens = 3
    req.append_output_token_ids([5, 6, 7])  # 6 tokens, hashes for 3 blocks
    req.num_in_flight_tokens = 0
    mgr.allocate_slots(req, 3)  # processed 3: block 0 (positions 0, 1) out; then blocks 1, 2 cached
    table = mgr.get_blocks("a")
    assert table[0] is mgr.block_pool.null_block and mgr.block_pool.null_block.block_hash is None
    assert len(update_block_hashes(req, 2)) == 3
    assert all(b.block_hash is not None for b in table[1:3])


def test_a_global_layer_frees_nothing():
    def model(windows):
        return ModelConfig(model="m", architecture="MistralForCausalLM", hf_config={}, dtype="float32",
                           max_model_len=64, vocab_size=10, num_layers=len(windows) or 2, num_kv_heads=1,
                           head_dim=4, eos_token_id=None, sliding_windows=windows)

    assert model(()).kv_sliding_window is None
    assert model((8, None)).kv_sliding_window is None
    assert model((8, 8)).kv_sliding_window == 8
    assert model((4, 8)).kv_sliding_window == 8  # one table for every layer: the widest window decides
    h = Harness(block_size=2, sliding_window=model((4, None)).kv_sliding_window)
    h.add("a", list(range(100, 120)), max_tokens=10)
    h.run()
    assert h.sched.kv_cache_manager.num_window_freed_blocks == 0


@pytest.mark.parametrize("is_async", [False, True])
def test_window_lets_a_tight_pool_run_without_preemption(is_async):
    """Through the scheduler and the scripted worker (which reads each step's window back from the
    KV it wrote): three long decodes fit a pool where full attention must preempt, with equal tokens."""
    runs = {}
    for window in (None, 6):
        h = Harness(is_async=is_async, block_size=4, num_blocks=12, max_model_len=44, sliding_window=window)
        for i in range(3):
            h.add(f"r{i}", [10 + i] * 6, max_tokens=36)
        h.run()
        runs[window] = (dict(h.delivered), h.sched.num_preemptions, h.sched.kv_cache_manager)
    assert runs[6][0] == runs[None][0]
    assert all(len(t) == 36 for t in runs[6][0].values())
    assert runs[None][1] > 0 and runs[6][1] == 0
    kv = runs[6][2]
    assert kv.num_window_freed_blocks > 0 and kv.num_free_blocks == kv.num_usable_blocks

