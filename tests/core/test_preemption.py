"""Preemption while steps are in flight: stale output (deliver and drop modes), deferred frees, liveness."""

from __future__ import annotations

import logging

import pytest

from stepahead.config import CacheConfig, SchedulerConfig
from stepahead.core.sched_output import ModelRunnerOutput
from stepahead.core.scheduler import Scheduler
from stepahead.request import RequestStatus
from tests.core.harness import EOS, Harness

MODES = [(False, 1), (False, 2), (True, 2), (True, 3)]


def _tight(is_async, depth, **kw):
    # 4 usable blocks of 4 tokens; two requests of 4 + 10 tokens cannot both fit.
    return Harness(is_async=is_async, depth=depth, block_size=4, num_blocks=5, **kw)


@pytest.mark.parametrize("is_async,depth", MODES)
def test_preempted_equals_unpreempted(is_async, depth):
    h = _tight(is_async, depth)
    for rid in ("a", "b", "c"):
        h.add(rid, [ord(rid)] * 4, max_tokens=10)
    h.run()
    assert h.sched.num_preemptions > 0
    for rid in ("a", "b", "c"):
        assert h.delivered[rid] == h.expected_tokens(rid, 10), rid
        assert h.finished[rid].finish_reason == "length"
    assert h.sched.kv_cache_manager.num_free_blocks == 4


def _run_until_preempted(h: Harness):
    """Step the engine loop; return right after the schedule() that preempted."""
    for _ in range(200):
        if h.sched.has_requests():
            before = h.sched.num_preemptions
            h.schedule()
            if h.sched.num_preemptions > before:
                return
            if len(h.in_flight) < h.depth:
                continue
        h.process()
    raise AssertionError("no preemption happened")


def test_async_preemption_in_flight_deliver_mode():
    h = _tight(True, 2)
    h.add("a", [1] * 4, max_tokens=10)
    b = h.add("b", [2] * 4, max_tokens=10)
    _run_until_preempted(h)
    so = h.in_flight[-1][0]
    assert b.status == RequestStatus.PREEMPTED and "b" in so.preempted_req_ids
    assert b.num_computed_tokens == 0 and b.num_output_placeholders == 0
    assert b.num_stale_output_tokens == b.num_in_flight_tokens > 0 and not b.drop_stale_output
    assert h.sched.waiting[0] is b
    assert not so.scheduled_new_reqs and "b" not in so.num_scheduled_tokens
    num_output_before = b.num_output_tokens
    # The stale output is delivered (appended), without touching the reset counters.
    while b.num_stale_output_tokens:
        so = h.schedule()
        assert "b" not in so.num_scheduled_tokens, "stale-gated request must not be re-admitted"
        if b.num_stale_output_tokens:
            assert b in h.sched.skipped_waiting or b in h.sched.waiting
        h.process()
        assert b.num_output_placeholders == 0 and b.num_computed_tokens == 0
    assert b.num_output_tokens > num_output_before
    h.run()
    assert h.delivered["b"] == h.expected_tokens("b", 10)
    assert b.num_preemptions >= 1


def test_resumed_request_data():
    h = _tight(True, 2)
    h.add("a", [1] * 4, max_tokens=10)
    b = h.add("b", [2] * 4, max_tokens=10)
    _run_until_preempted(h)
    for _ in range(50):
        so = h.schedule()
        if "b" in so.scheduled_cached_reqs.resumed_req_ids:
            c = so.scheduled_cached_reqs
            k = c.req_ids.index("b")
            assert c.all_token_ids["b"] == b.all_token_ids
            assert c.num_computed_tokens[k] == b.num_computed_tokens - so.num_scheduled_tokens["b"]
            assert c.new_block_ids[k] == h.sched.kv_cache_manager.get_block_ids("b")
            assert c.num_output_tokens[k] == b.num_output_tokens
            break
        h.process()
    else:
        raise AssertionError("b never resumed")
    h.run()
    assert h.delivered["b"] == h.expected_tokens("b", 10)


def test_stale_output_carrying_eos_finishes_preempted_request():
    h = _tight(True, 2)
    h.add("a", [1] * 4, max_tokens=10)
    b = h.add("b", [2] * 4, max_tokens=10)
    _run_until_preempted(h)
    assert b.status == RequestStatus.PREEMPTED and b.num_stale_output_tokens > 0
    so, real = h.in_flight[0]
    assert "b" in so.num_scheduled_tokens
    sampled = [[EOS] if rid == "b" else toks for rid, toks in zip(real.req_ids, real.sampled_token_ids, strict=True)]
    outs = h.process(ModelRunnerOutput(real.req_ids, sampled))
    (ob,) = [o for o in outs if o.request_id == "b"]
    assert ob.new_token_ids == [EOS] and ob.finish_reason == "stop"
    assert "b" not in h.sched.requests and b not in h.sched.waiting and b not in h.sched.skipped_waiting
    h.run()
    assert h.delivered["a"] == h.expected_tokens("a", 10)
    assert h.sched.kv_cache_manager.num_free_blocks == 4


@pytest.mark.parametrize("depth", [2, 3])
def test_drop_mode_via_reset_prefix_cache(depth):
    h = Harness(is_async=True, depth=depth)
    reqs = [h.add(f"r{i}", [i + 1] * 6, max_tokens=8) for i in range(3)]
    for _ in range(5):
        h.step()
    assert all(r.num_in_flight_tokens > 0 for r in reqs)
    assert h.sched.reset_prefix_cache(reset_running_requests=True)
    assert h.sched.running == [] and list(h.sched.waiting) == reqs  # reverse preemption keeps FIFO
    assert h.sched.kv_cache_manager.block_pool.cached_block_hash_to_block == {}
    for r in reqs:
        assert r.drop_stale_output and r.num_stale_output_tokens == r.num_in_flight_tokens
        assert r.num_output_placeholders == 0 and r.num_computed_tokens == 0
    num_output_before = [r.num_output_tokens for r in reqs]
    so = h.schedule()  # drop mode: re-admitted at once, even with stale output in flight
    assert set(so.scheduled_cached_reqs.resumed_req_ids) == {r.request_id for r in reqs}
    assert so.preempted_req_ids == {r.request_id for r in reqs}
    while any(r.num_stale_output_tokens for r in reqs):
        outs = h.process()
        assert not [o for o in outs if any(o.request_id == r.request_id and r.num_stale_output_tokens
                                           for r in reqs)]
    assert [r.num_output_tokens for r in reqs] == num_output_before, "dropped stale output is never appended"
    h.run()
    for r in reqs:
        assert h.delivered[r.request_id] == h.expected_tokens(r.request_id, 8)


def test_reset_with_nothing_in_flight_loses_no_token():
    """The stale share equals what is in flight; with nothing in flight, no output is discarded."""
    h = Harness(is_async=True, depth=1)
    r = h.add("r", [3] * 5, max_tokens=6)
    for _ in range(3):
        h.step()
    assert r.num_in_flight_tokens == 0
    h.sched.reset_prefix_cache(reset_running_requests=True)
    assert r.num_stale_output_tokens == 0
    h.run()
    assert h.delivered["r"] == h.expected_tokens("r", 6)


def test_reset_prefix_cache_fails_while_blocks_held():
    h = Harness()
    h.add("r", [3] * 5, max_tokens=6)
    h.step()
    assert not h.sched.reset_prefix_cache()
    h.run()
    assert h.sched.reset_prefix_cache()


def test_liveness_admits_when_running_is_empty():
    """Running empty, waiting non-empty, pool free -> the next schedule admits someone."""
    h = _tight(True, 2)
    for rid in ("a", "b", "c", "d"):
        h.add(rid, [ord(rid)] * 4, max_tokens=10)
    for _ in range(2000):
        s = h.sched
        if not (s.has_requests() or h.in_flight):
            break
        idle = not s.running and (s.waiting or s.skipped_waiting)
        gated = any(r.num_stale_output_tokens and not r.drop_stale_output
                    for r in (*s.waiting, *s.skipped_waiting))
        h.step()
        if idle and not gated:
            assert s.running, "nothing admitted although the pool was free"
    assert all(h.delivered[r] == h.expected_tokens(r, 10) for r in "abcd")


@pytest.mark.parametrize("is_async,depth", MODES)
def test_request_outgrowing_a_small_pool_finishes_with_length(is_async, depth):
    """A pool smaller than one max_model_len sequence: the request that fills it stops, the next runs.

    2 usable blocks of 4 tokens hold 8 positions, so a request can reach 9 tokens. Without the cap
    the growing request preempted itself forever and "b" never ran.
    """
    h = Harness(is_async=is_async, depth=depth, block_size=4, num_blocks=3, max_model_len=64)
    h.add("a", [1] * 4, max_tokens=20)
    h.add("b", [2] * 3, max_tokens=2)
    h.run(max_steps=500)
    assert h.finished["a"].finish_reason == "length"
    assert h.delivered["a"] == h.expected_tokens("a", 9 - 4)
    assert h.finished["b"].finish_reason == "length" and h.delivered["b"] == h.expected_tokens("b", 2)
    assert h.sched.num_wasted_request_steps == 0
    assert h.sched.kv_cache_manager.num_free_blocks == 2


def test_small_pool_warns_once_at_construction(caplog):
    with caplog.at_level(logging.WARNING, logger="stepahead.core.scheduler"):
        Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4, num_blocks=3))
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "holds 8 tokens" in caplog.text and "finishes with finish_reason 'length'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stepahead.core.scheduler"):
        Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4, num_blocks=17))
    assert not caplog.records
