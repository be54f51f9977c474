"""Draft tokens as placeholders: the scheduler's counters, step by step (docs/design.md, "Draft tokens
as placeholders").

Hand-written steps drive the scheduler with chosen worker outputs and pin every counter; the
harness runs end to end with the scripted worker's random drafts and acceptance.
"""

from __future__ import annotations

import pytest

from stepahead.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from stepahead.core.async_scheduler import AsyncScheduler
from stepahead.core.invariants import check_after_schedule, check_scheduler
from stepahead.core.sched_output import ModelRunnerOutput
from stepahead.core.scheduler import Scheduler
from stepahead.engine.arg_utils import EngineArgs
from stepahead.request import Request
from stepahead.sampling_params import SamplingParams, StructuredOutputsParams
from tests.core.harness import EOS, Harness

PROMPT = [5, 6, 7, 8]  # P = 4


def _sched(cls=AsyncScheduler, k=2, **kw):
    return cls(SchedulerConfig(num_speculative_tokens=k, **kw), CacheConfig(block_size=4, num_blocks=32))


def _add(s, max_tokens=10, rid="r", **kw):
    req = Request(rid, PROMPT, SamplingParams(max_tokens=max_tokens, **kw), eos_token_id=EOS)
    s.add_request(req)
    return req


def _counters(req):
    """(num_tokens, num_computed_tokens, num_output_placeholders, num_in_flight_draft_tokens, num_in_flight_tokens)"""
    return (req.num_tokens, req.num_computed_tokens, req.num_output_placeholders, req.num_in_flight_draft_tokens,
            req.num_in_flight_tokens)


class Steps:
    """schedule()/update() with the invariants checked after each, against the steps still in flight."""

    def __init__(self, s):
        self.s = s
        self.in_flight = []

    def schedule(self):
        so = self.s.schedule()
        self.in_flight.append(so)
        check_after_schedule(self.s, so)
        check_scheduler(self.s, self.in_flight)
        return so

    def update(self, sampled, drafts=None, slots=None):
        so = self.in_flight.pop(0)
        rids = list(so.num_scheduled_tokens)
        rows = [sampled.get(rid, []) for rid in rids]
        outs = self.s.update_from_output(so, ModelRunnerOutput(rids, rows, draft_token_ids=drafts or {},
                                                               draft_slots=slots or {}))
        check_scheduler(self.s, self.in_flight)
        return outs


def _start(max_tokens=10):
    """Async, k=2: the prefill step, then the first step with two draft placeholders, both in flight."""
    steps = Steps(_sched())
    req = _add(steps.s, max_tokens)
    s1 = steps.schedule()
    assert s1.num_scheduled_tokens == {"r": 4} and not s1.scheduled_spec_decode_tokens
    assert _counters(req) == (4, 4, 1, 0, 4) and req.spec_token_ids == [-1, -1]
    s2 = steps.schedule()  # gap = 4 + 2 drafts + 1 placeholder - 4 computed = 3
    assert s2.num_scheduled_tokens == {"r": 3} and s2.scheduled_spec_decode_tokens == {"r": [-1, -1]}
    assert _counters(req) == (4, 7, 4, 2, 7)
    (o,) = steps.update({"r": [10]})
    assert o.new_token_ids == [10]
    assert _counters(req) == (5, 7, 3, 2, 3)  # num_tokens + placeholders == computed + 1
    return steps, req


def test_all_drafts_accepted():
    steps, req = _start()
    s3 = steps.schedule()
    assert s3.num_scheduled_tokens == {"r": 3} and _counters(req) == (5, 10, 6, 4, 6)
    (o,) = steps.update({"r": [11, 12, 13]})  # both drafts and the token after them
    assert o.new_token_ids == [11, 12, 13] and o.finish_reason is None
    assert _counters(req) == (8, 10, 3, 2, 3)
    assert (steps.s.num_draft_tokens, steps.s.num_accepted_tokens) == (2, 2)


def test_no_draft_accepted():
    steps, req = _start()
    steps.schedule()
    (o,) = steps.update({"r": [11]})  # the first draft was wrong: one token, two positions rolled back
    assert o.new_token_ids == [11]
    assert _counters(req) == (6, 8, 3, 2, 3)
    # The next step starts right after the real tokens: the rejected positions are scheduled again.
    s4 = steps.schedule()
    assert s4.num_scheduled_tokens == {"r": 3} and s4.scheduled_cached_reqs.num_computed_tokens == [8]
    assert _counters(req) == (6, 11, 6, 4, 6)
    (o,) = steps.update({"r": [12, 13]})  # one of step 3's drafts accepted
    assert _counters(req) == (8, 10, 3, 2, 3)
    assert (steps.s.num_draft_tokens, steps.s.num_accepted_tokens) == (4, 1)


def test_cache_frontier_only_over_verified_tokens():
    steps, req = _start()
    kv = steps.s.kv_cache_manager
    steps.schedule()
    steps.update({"r": [11, 12, 13]})  # 8 real tokens, two more drafts in flight
    # Block 1 (positions 4..7) is full of real tokens but position 7's token was sampled, not yet
    # computed: the frontier num_computed - placeholders = 7 leaves it unhashed.
    assert req.num_computed_tokens - req.num_output_placeholders == 7
    assert [b.block_hash is not None for b in kv.get_blocks("r")] == [True, False, False]


def test_stop_token_inside_accepted_run_cuts_it():
    steps, req = _start()
    steps.schedule()
    (o,) = steps.update({"r": [11, EOS, 13]})
    assert o.new_token_ids == [11, EOS] and o.finish_reason == "stop"
    assert req.output_token_ids == [10, 11, EOS] and "r" not in steps.s.requests
    assert steps.update({"r": [14, 15]}) == []  # the step behind it is wasted, its output dropped
    assert steps.s.num_wasted_request_steps == 1


def test_stop_token_id_inside_run_sets_stop_reason():
    steps = Steps(_sched())
    _add(steps.s, 10, stop_token_ids=[12])
    steps.schedule()
    steps.schedule()
    steps.update({"r": [10]})
    steps.schedule()
    (o,) = steps.update({"r": [11, 12, 13]})
    assert o.new_token_ids == [11, 12] and o.finish_reason == "stop" and o.stop_reason == 12


def test_max_tokens_reached_inside_run_and_drafts_capped():
    steps, req = _start(max_tokens=4)
    # Counting every placeholder in flight as a token (3), one more sample fills max_tokens: no drafts.
    s3 = steps.schedule()
    assert s3.num_scheduled_tokens == {"r": 1} and "r" not in s3.scheduled_spec_decode_tokens
    assert _counters(req) == (5, 8, 4, 2, 4)
    (o,) = steps.update({"r": [11, 12, 13]})
    assert o.new_token_ids == [11, 12, 13] and o.finish_reason == "length"
    # The guard's price: with high acceptance, the step behind a full run is wasted (vLLM's too).
    assert steps.update({"r": [14]}) == []


def test_max_tokens_guard_ignores_drafts_that_may_be_rejected():
    steps = Steps(_sched())
    req = _add(steps.s, max_tokens=3)
    steps.schedule()
    s2 = steps.schedule()  # room for one draft: 1 token in flight + 1 + 1 = max_tokens
    assert s2.scheduled_spec_decode_tokens == {"r": [-1]} and _counters(req) == (4, 6, 3, 1, 6)
    steps.update({"r": [10]})
    # Sure tokens once in flight returns: 5 + (2 placeholders - 1 draft) = 6 < 4 + 3: schedule.
    s3 = steps.schedule()
    assert s3.num_scheduled_tokens == {"r": 1} and not s3.scheduled_spec_decode_tokens
    # Now the sure tokens reach the cap: nothing more is scheduled.
    assert steps.schedule().num_scheduled_tokens == {}


def test_drafts_capped_by_max_model_len():
    steps = Steps(_sched(max_model_len=8))
    req = _add(steps.s, None)
    steps.schedule()
    steps.update({"r": [10]})
    s2 = steps.schedule()  # positions 4..6 fit below max_model_len - 1 = 7 with both drafts
    assert s2.num_scheduled_tokens == {"r": 3} and s2.scheduled_spec_decode_tokens == {"r": [-1, -1]}
    (o,) = steps.update({"r": [11, 12, 13]})
    assert o.finish_reason == "length" and req.num_tokens == 8


def test_preemption_with_draft_step_in_flight_delivers_stale_tokens():
    steps, req = _start()
    s = steps.s
    steps.schedule()  # two steps in flight, each with two drafts
    assert _counters(req) == (5, 10, 6, 4, 6)
    s.running.remove(req)
    s._preempt_request(req, drop_stale_output=False)  # what KV pressure does
    assert _counters(req) == (5, 0, 0, 0, 6) and req.num_stale_output_tokens == 6 and req.spec_token_ids == []
    assert steps.schedule().num_scheduled_tokens == {}  # stale-gated
    (o,) = steps.update({"r": [11]})  # its drafts were rejected: nothing is rolled back
    assert o.new_token_ids == [11] and _counters(req) == (6, 0, 0, 0, 3) and req.num_stale_output_tokens == 3
    (o,) = steps.update({"r": [12, 13, 14]})
    assert o.new_token_ids == [12, 13, 14] and _counters(req) == (9, 0, 0, 0, 0)
    steps.update({})  # the empty step
    resumed = steps.schedule()  # a recompute of the known tokens past the prompt's cached block, no drafts
    assert resumed.num_scheduled_tokens == {"r": 5} and not resumed.scheduled_spec_decode_tokens
    assert _counters(req) == (9, 9, 1, 0, 5) and req.spec_token_ids == [-1, -1]


def test_drop_mode_discards_stale_draft_output():
    steps, req = _start()
    steps.schedule()
    steps.s.reset_prefix_cache(reset_running_requests=True)
    assert steps.update({"r": [11, 12, 13]}) == [] and _counters(req) == (5, 0, 0, 0, 3)


def test_sync_drafts_come_from_the_worker():
    steps = Steps(_sched(Scheduler, k=3))
    req = _add(steps.s)
    s1 = steps.schedule()
    assert not s1.scheduled_spec_decode_tokens
    (o,) = steps.update({"r": [10]}, drafts={"r": [11, 12, 99]})
    assert req.spec_token_ids == [11, 12, 99] and _counters(req) == (5, 4, 0, 0, 0)
    s2 = steps.schedule()
    assert s2.num_scheduled_tokens == {"r": 4} and s2.scheduled_spec_decode_tokens == {"r": [11, 12, 99]}
    assert req.spec_token_ids == [] and _counters(req) == (5, 8, 0, 3, 4)
    (o,) = steps.update({"r": [11, 12, 13]}, drafts={"r": [14, 15, 16]})
    assert o.new_token_ids == [11, 12, 13] and _counters(req) == (8, 7, 0, 0, 0)
    assert req.spec_token_ids == [14, 15, 16]


def test_sync_proposals_of_any_length_up_to_k():
    steps = Steps(_sched(Scheduler, k=3))
    req = _add(steps.s)
    steps.schedule()
    steps.update({"r": [10]}, drafts={"r": [11]})  # a proposer may find fewer than k, or none
    s2 = steps.schedule()
    assert s2.num_scheduled_tokens == {"r": 2} and s2.scheduled_spec_decode_tokens == {"r": [11]}
    steps.update({"r": [11, 12]}, drafts={"r": []})
    s3 = steps.schedule()
    assert s3.num_scheduled_tokens == {"r": 1} and not s3.scheduled_spec_decode_tokens
    assert _counters(req) == (7, 7, 0, 0, 1)


def test_sync_drafts_capped_by_max_tokens_and_ignored_after_stop():
    steps = Steps(_sched(Scheduler, k=3))
    req = _add(steps.s, max_tokens=3)
    steps.schedule()
    steps.update({"r": [10]}, drafts={"r": [11, 12, 13]})
    s2 = steps.schedule()  # one token sampled, two left: at most one draft
    assert s2.scheduled_spec_decode_tokens == {"r": [11]} and s2.num_scheduled_tokens == {"r": 2}
    (o,) = steps.update({"r": [11, 12]}, drafts={"r": [13]})
    assert o.finish_reason == "length" and req.output_token_ids == [10, 11, 12]


def test_structured_output_requests_draft():
    """A grammar request drafts like any other (the grammar's check and per-position masks are the
    structured-output manager's: tests/structured_output/); the async scheduler keeps the worker's
    proposals, which fill the request's next slots, for the bitmask."""
    steps = Steps(_sched(Scheduler))
    req = _add(steps.s, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    steps.schedule()
    steps.update({"r": [10]}, drafts={"r": [11, 12]})
    assert req.spec_token_ids == [11, 12]
    assert steps.schedule().scheduled_spec_decode_tokens == {"r": [11, 12]}
    steps = Steps(_sched(AsyncScheduler))
    req = _add(steps.s, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    steps.schedule()
    assert req.spec_token_ids == [-1, -1]
    steps.update({"r": [10]}, drafts={"r": [11]})
    assert req.worker_draft_token_ids == [11]
    s2 = steps.schedule()
    assert s2.scheduled_spec_decode_tokens == {"r": [-1, -1]}
    assert steps.s._step_drafts(req, [-1, -1]) == [11, 10]  # padded with the last token, as the worker pads


def test_async_reserves_the_slots_the_worker_asks_for():
    """A worker whose drafts keep missing asks for fewer slots (down to none); the async scheduler
    reserves that many after each sampling step from then on (the step already planned keeps its
    slots), and more again when asked."""
    steps, req = _start()
    steps.update({"r": [11]}, slots={"r": 0})  # step 2: both drafts rejected; no more, says the worker
    assert _counters(req) == (6, 5, 0, 0, 0) and req.spec_token_ids == [-1, -1]
    s3 = steps.schedule()  # reserved when step 2 was scheduled
    assert s3.num_scheduled_tokens == {"r": 3} and req.spec_token_ids == []
    s4 = steps.schedule()
    assert s4.num_scheduled_tokens == {"r": 1} and not s4.scheduled_spec_decode_tokens
    steps.update({"r": [12]}, slots={"r": 1})
    assert req.spec_token_ids == []
    steps.update({"r": [13]})
    s5 = steps.schedule()
    assert s5.num_scheduled_tokens == {"r": 1} and req.spec_token_ids == [-1]
    s6 = steps.schedule()
    assert s6.num_scheduled_tokens == {"r": 2} and s6.scheduled_spec_decode_tokens == {"r": [-1]}


def test_off_by_default_nothing_drafted():
    steps = Steps(Scheduler(SchedulerConfig(), CacheConfig(block_size=4, num_blocks=32)))
    req = _add(steps.s)
    steps.schedule()
    steps.update({"r": [10]}, drafts={"r": [11, 12]})  # a worker's proposals are ignored
    assert req.spec_token_ids == [] and not steps.schedule().scheduled_spec_decode_tokens


def test_speculative_config_refuses_what_the_worker_cannot_run():
    with pytest.raises(ValueError, match="speculative_config.model must name the draft checkpoint"):
        EngineArgs(speculative_config='{"method": "draft_model", "num_speculative_tokens": 4}')
    with pytest.raises(ValueError, match="speculative_config.model must name .* only for it, got .x."):
        EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 4, "model": "x"}')
    # Host-side proposers run on the sampler rank of any layout; a draft model only at one rank.
    EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}', tensor_parallel_size=2)
    EngineArgs(speculative_config='{"method": "suffix", "num_speculative_tokens": 4}', pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="method draft_model runs on one worker rank; tensor_parallel_size=2 x "
                                         "pipeline_parallel_size=1 is not supported with it"):
        EngineArgs(speculative_config='{"method": "draft_model", "num_speculative_tokens": 4, "model": "x"}',
                   tensor_parallel_size=2)
    with pytest.raises(ValueError, match="prompt_lookup_max must be an int >= prompt_lookup_min"):
        SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3,
                                     "prompt_lookup_max": 2})
    # vLLM's defaults: 5 and 5 when neither is given, the other's value when one is.
    assert SpeculativeConfig("ngram", 4).prompt_lookup_min == 5
    given = SpeculativeConfig("ngram", 4, prompt_lookup_max=3)
    assert (given.prompt_lookup_min, given.prompt_lookup_max) == (3, 3)
    with pytest.raises(ValueError, match="speculative_config.method must be one of"):
        EngineArgs(speculative_config={"method": "eagle", "num_speculative_tokens": 4})
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4, "k": 1})
    with pytest.raises(ValueError, match="speculative_config.draft_policy must be one of cost, acceptance"):
        SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4, "draft_policy": "always"})
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 0"):
        SchedulerConfig(num_speculative_tokens=-1)


@pytest.mark.parametrize("is_async,depth", [(False, 1), (True, 2), (True, 3)])
@pytest.mark.parametrize("k", [1, 3])
def test_scripted_drafts_give_the_scripted_tokens(is_async, depth, k):
    """Random drafts and acceptance, a pool tight enough to preempt, chunked prefills, prefix hits."""
    h = Harness(is_async=is_async, depth=depth, block_size=2, num_blocks=14, budget=6, max_model_len=24,
                num_spec_tokens=k, draft_seed=depth * 10 + k)
    plan = {f"r{i}": (1 + i % 3, 3 + 2 * i) for i in range(8)}  # eos_at, max_tokens
    for rid, (eos_at, max_tokens) in plan.items():
        h.add(rid, [7, 8, 9, 10, int(rid[1:])], max_tokens=max_tokens, eos_at=eos_at * 4)
    h.run()
    for rid, (eos_at, max_tokens) in plan.items():
        n = min(eos_at * 4, max_tokens)
        assert h.delivered[rid] == h.expected_tokens(rid, n), rid
        assert h.finished[rid].finish_reason == ("stop" if eos_at * 4 <= max_tokens else "length")
    assert 0 < h.sched.num_accepted_tokens < h.sched.num_draft_tokens
    assert h.sched.num_preemptions > 0 or not is_async
    assert h.sched.kv_cache_manager.prefix_cache_hits > 0
    assert not h.sched.requests and h.sched.kv_cache_manager.num_free_blocks == 13
