"""Property tests: random adds, steps, outputs with random EOS, aborts, resets and tight pools, with
and without random drafts and acceptance, with and without a sliding window, under the fcfs and the
priority scheduling policy (random priorities: urgent requests displace running ones).

The harness checks the invariants after every operation; at the end every request must have
received exactly the scripted tokens (async == sync, preempted == unpreempted, cached == uncached)
and the pool must be whole again.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from stepahead.core.invariants import check_scheduler
from stepahead.request import RequestStatus
from stepahead.utils import cdiv
from tests.core.harness import Harness

configs = st.fixed_dictionaries({
    "is_async": st.booleans(),
    "depth": st.integers(1, 3),
    "block_size": st.sampled_from([1, 2, 4]),
    "extra_blocks": st.integers(0, 8),
    "budget": st.integers(1, 24),
    "max_num_seqs": st.integers(1, 5),
    "max_model_len": st.integers(8, 40),
    "caching": st.booleans(),
    "num_spec_tokens": st.sampled_from([0, 0, 1, 2, 4]),
    "draft_seed": st.integers(0, 1000),
    # Every layer windowed: blocks out of the window go back to the pool as requests advance.
    "sliding_window": st.sampled_from([None, None, 2, 3, 5, 8]),
    "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
})

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 10_000)),
        st.tuples(st.just("add"), st.integers(0, 10_000)),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 100)),
        st.tuples(st.just("reset"), st.booleans()),
    ),
    min_size=8, max_size=60,
)


def _expected(h: Harness, rid: str, prompt_len: int, max_tokens: int, eos_at: int) -> tuple[int, str]:
    limit = min(max_tokens, h.sched.max_model_len - prompt_len)
    if eos_at and eos_at <= limit:
        return eos_at, "stop"
    return limit, "length"


# STEPAHEAD_FUZZ_EXAMPLES raises the count for a long local run.
@settings(max_examples=int(os.environ.get("STEPAHEAD_FUZZ_EXAMPLES", 600)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, program=ops, data=st.data())
def test_random_programs_keep_invariants_and_tokens(cfg, program, data):
    cfg = dict(cfg)
    # The pool holds at least one max_model_len sequence, as EngineArgs enforces.
    cfg["num_blocks"] = cdiv(cfg["max_model_len"], cfg["block_size"]) + 1 + cfg.pop("extra_blocks")
    h = Harness(**cfg)
    max_prompt = cfg["max_model_len"] - 1
    plan: dict[str, tuple[int, int, int]] = {}
    aborted: set[str] = set()
    n_added = 0
    for op, arg in program:
        if op == "add":
            reuse = [r for r in plan if r in h.finished or r in aborted]
            rid = reuse[arg % len(reuse)] if reuse and arg % 4 == 0 else f"r{n_added}"
            n_added += 1
            plen = 1 + arg % max_prompt
            base = (arg // 7) % 3  # a few shared prefixes, so prefix hits happen
            prompt = [10 + base] * (plen // 2) + [20 + (arg % 5)] * (plen - plen // 2)
            max_tokens = 1 + (arg // 3) % 10
            eos_at = data.draw(st.integers(0, 6), label="eos_at")
            priority = data.draw(st.integers(0, 3), label="priority") if cfg["scheduling_policy"] == "priority" else 0
            h.add(rid, prompt, max_tokens=max_tokens, eos_at=eos_at, priority=priority)
            plan[rid] = (plen, max_tokens, eos_at)
            aborted.discard(rid)
        elif op == "step":
            for _ in range(arg):
                h.step()
        elif op == "abort":
            live = sorted(h.sched.requests)
            if live:
                rid = live[arg % len(live)]
                h.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)
        elif op == "reset":
            h.sched.reset_prefix_cache(reset_running_requests=arg)
        check_scheduler(h.sched, [s for s, _ in h.in_flight])
    h.run(max_steps=5_000)
    for rid, (plen, max_tokens, eos_at) in plan.items():
        got = h.delivered.get(rid, [])
        if rid in aborted:
            assert got == h.expected_tokens(rid, len(got)) and rid not in h.finished
            continue
        n, reason = _expected(h, rid, plen, max_tokens, eos_at)
        assert got == h.expected_tokens(rid, n), rid
        assert h.finished[rid].finish_reason == reason
    event(f"preempted: {h.sched.num_preemptions > 0} ({cfg['scheduling_policy']})")
    event(f"wasted: {h.sched.num_wasted_request_steps > 0}")
    event(f"prefix hits: {h.sched.kv_cache_manager.prefix_cache_hits > 0}")
    if cfg["sliding_window"]:
        event(f"blocks out of the window: {h.sched.kv_cache_manager.num_window_freed_blocks > 0}")
    if cfg["num_spec_tokens"]:
        event(f"drafts rejected: {h.sched.num_accepted_tokens < h.sched.num_draft_tokens}")
        event(f"drafts accepted: {h.sched.num_accepted_tokens > 0}")
    kv = h.sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert not h.sched.requests and not h.sched.finished_in_flight_tokens
    if not cfg["is_async"] and cfg["depth"] == 1:
        assert h.sched.num_wasted_request_steps == 0
