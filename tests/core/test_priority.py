"""The priority scheduling policy: the waiting queue by (priority, arrival), urgent requests displace
running ones of a strictly worse priority (for a seat or for KV blocks), and every request still gets
its scripted tokens, sync and async, with steps in flight when the displaced request is preempted."""

from __future__ import annotations

import pytest

from tests.core.harness import Harness

MODES = [(False, 1), (True, 2), (True, 3)]


def _finish_order(h: Harness) -> list[str]:
    order: list[str] = []
    while h.sched.has_requests() or h.in_flight:
        for out in h.step():
            if out.finish_reason is not None:
                order.append(out.request_id)
    return order


def _check_tokens(h: Harness, max_tokens: dict[str, int]) -> None:
    for rid, n in max_tokens.items():
        assert h.delivered[rid] == h.expected_tokens(rid, n), rid
        assert h.finished[rid].finish_reason == "length"
    assert h.sched.kv_cache_manager.num_free_blocks == h.sched.kv_cache_manager.num_usable_blocks


@pytest.mark.parametrize("is_async,depth", MODES)
def test_waiting_requests_run_by_priority_then_arrival(is_async, depth):
    h = Harness(is_async=is_async, depth=depth, max_num_seqs=1, scheduling_policy="priority")
    for rid, priority in (("a", 2), ("b", 0), ("c", 1), ("d", 0)):
        h.add(rid, [5] * 4, max_tokens=3, priority=priority)
    assert [r.request_id for r in h.sched.waiting] == ["b", "d", "c", "a"]
    assert _finish_order(h) == ["b", "d", "c", "a"]
    assert h.sched.num_preemptions == 0
    _check_tokens(h, dict.fromkeys("abcd", 3))


@pytest.mark.parametrize("is_async,depth", MODES)
def test_an_urgent_request_takes_the_seat_of_a_running_one(is_async, depth):
    """One seat: a request arriving later with a better priority preempts the running one (steps of it in
    flight) and finishes first; the preempted one resumes and gets its tokens. Equal priority waits."""
    h = Harness(is_async=is_async, depth=depth, max_num_seqs=1, scheduling_policy="priority")
    h.add("slow", [7] * 4, max_tokens=12, priority=5)
    for _ in range(4):
        h.step()
    assert [r.request_id for r in h.sched.running] == ["slow"]
    h.add("same", [8] * 4, max_tokens=2, priority=5)
    h.add("urgent", [9] * 4, max_tokens=4, priority=1)
    assert _finish_order(h) == ["urgent", "slow", "same"]
    assert h.sched.num_preemptions == 1
    _check_tokens(h, {"slow": 12, "same": 2, "urgent": 4})


@pytest.mark.parametrize("is_async,depth", MODES)
def test_short_kv_preempts_the_least_urgent_running_request(is_async, depth):
    """4 usable blocks of 4 tokens: when a running request needs a block, the victim is the least urgent
    running request (under fcfs it would be the last admitted)."""
    h = Harness(is_async=is_async, depth=depth, block_size=4, num_blocks=5, scheduling_policy="priority")
    low = h.add("low", [1] * 4, max_tokens=10, priority=3)
    high = h.add("high", [2] * 4, max_tokens=10, priority=0)
    assert _finish_order(h)[0] == "high"
    assert low.num_preemptions > 0 and high.num_preemptions == 0
    _check_tokens(h, {"low": 10, "high": 10})


@pytest.mark.parametrize("is_async,depth", MODES)
def test_a_request_taking_a_seat_mid_prefill_leaves_no_uncomputed_block_cached(is_async, depth):
    """Found by the fuzz: a less urgent request is preempted halfway through its chunked prefill with the
    prefix cache on; its blocks must hold only positions it computed, so that resuming it from the cache
    reads its own tokens (the scripted worker checks every position's KV)."""
    h = Harness(is_async=is_async, depth=depth, block_size=1, num_blocks=18, budget=4, max_num_seqs=1,
                max_model_len=17, scheduling_policy="priority")
    h.add("a", [11] * 6 + [22] * 7, max_tokens=5, priority=0)
    for _ in range(6):
        h.step()
    h.add("b", [10] * 3 + [20] * 3, max_tokens=2, priority=1)
    for _ in range(2):
        h.step()
    h.add("c", [20], max_tokens=1, priority=0)
    h.run()
    _check_tokens(h, {"a": 4, "b": 2, "c": 1})


def test_fcfs_never_displaces():
    h = Harness(max_num_seqs=1)
    h.add("first", [7] * 4, max_tokens=6)
    h.step()
    h.add("second", [8] * 4, max_tokens=2)
    assert _finish_order(h) == ["first", "second"]
    assert h.sched.num_preemptions == 0
