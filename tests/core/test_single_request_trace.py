"""One request traced through the real scheduler, step by step (docs/design.md, "EOS waste").

A 6-token prompt with a budget of 4 tokens: two prefill chunks, then one token per step. Case 1
finishes at max_tokens and wastes nothing; case 2 samples EOS while the next step is in flight.
"""

from __future__ import annotations

import pytest

from tests.core.harness import EOS, Harness

PROMPT = [11, 12, 13, 14, 15, 16]


def _scheduled_tokens(h: Harness) -> list[int]:
    """Run to completion; return r0's scheduled token count per non-empty step."""
    counts = []
    while h.sched.has_requests() or h.in_flight:
        if h.sched.has_requests():
            so = h.schedule()
            counts.append(so.num_scheduled_tokens.get("r0", 0))
            if len(h.in_flight) < h.depth and (so.total_num_scheduled_tokens or h.sched.has_requests()):
                continue
        h.process()
    return counts


def test_case1_max_tokens_no_fifth_step_zero_waste():
    h = Harness(budget=4)
    h.add("r0", PROMPT, max_tokens=3)
    counts = _scheduled_tokens(h)
    assert counts[:4] == [4, 2, 1, 1]
    assert all(c == 0 for c in counts[4:]), "no step 5 for r0: the max_tokens guard knew it was done"
    assert h.sched.num_wasted_request_steps == 0
    assert h.delivered["r0"] == h.expected_tokens("r0", 3)
    assert h.finished["r0"].finish_reason == "length"


@pytest.mark.parametrize("eos_at,depth,wasted", [(2, 2, 1), (1, 2, 1), (2, 3, 2), (1, 3, 2), (2, 1, 0)])
def test_eos_wastes_depth_minus_one_steps(eos_at, depth, wasted):
    h = Harness(budget=4, depth=depth, is_async=depth > 1)
    h.add("r0", PROMPT, max_tokens=8, eos_at=eos_at)
    counts = _scheduled_tokens(h)
    assert h.sched.num_wasted_request_steps == wasted
    assert h.delivered["r0"] == h.expected_tokens("r0", eos_at)
    assert h.delivered["r0"][-1] == EOS
    assert h.finished["r0"].finish_reason == "stop"
    # Steps computed for r0 = prefill chunks + one per token + the wasted ones.
    assert sum(1 for c in counts if c) == 2 + eos_at + wasted - 1


def test_case2_counters_step_by_step():
    """Placeholders rise when a step is scheduled and fall when its token arrives."""
    h = Harness(budget=4)
    r = h.add("r0", PROMPT, max_tokens=8, eos_at=2)
    h.schedule()
    assert (r.num_computed_tokens, r.num_tokens, r.num_output_placeholders) == (4, 6, 0)
    h.schedule()
    assert (r.num_computed_tokens, r.num_tokens, r.num_output_placeholders) == (6, 6, 1)
    assert h.process() == []  # prefill chunk: nothing sampled
    h.schedule()
    assert (r.num_computed_tokens, r.num_tokens, r.num_output_placeholders) == (7, 6, 2)
    (o,) = h.process()
    assert o.new_token_ids == h.expected_tokens("r0", 1) and o.finish_reason is None
    assert (r.num_computed_tokens, r.num_tokens, r.num_output_placeholders) == (7, 7, 1)
    h.schedule()
    assert (r.num_computed_tokens, r.num_tokens, r.num_output_placeholders) == (8, 7, 2)
    (o,) = h.process()
    assert o.new_token_ids == [EOS] and o.finish_reason == "stop"
    assert "r0" not in h.sched.requests
    so5 = h.schedule()
    assert so5.finished_req_ids == {"r0"} and so5.total_num_scheduled_tokens == 0
    assert h.process() == []  # step 4's result: discarded
    assert h.sched.num_wasted_request_steps == 1


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_max_tokens_never_over_scheduled_at_any_depth(depth):
    h = Harness(budget=4, depth=depth)
    h.add("r0", PROMPT, max_tokens=5)
    counts = _scheduled_tokens(h)
    assert sum(1 for c in counts if c) == 2 + 5 - 1  # two prefill chunks, then one step per new token
    assert h.sched.num_wasted_request_steps == 0
