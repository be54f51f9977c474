"""Scheduler mechanisms: validation, chunking, stop checks, output contents, finishing, aborts."""

from __future__ import annotations

import pytest

from stepahead.config import CacheConfig, SchedulerConfig
from stepahead.core.async_scheduler import AsyncScheduler
from stepahead.core.sched_output import ModelRunnerOutput, TokenLogprobs
from stepahead.core.scheduler import Scheduler
from stepahead.request import Request, RequestStatus
from stepahead.sampling_params import SamplingParams
from tests.core.harness import EOS, Harness


def _req(rid, prompt, **kw):
    return Request(rid, prompt, SamplingParams(**kw), eos_token_id=EOS)


@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
def test_add_request_validation_changes_nothing(cls):
    s = cls(SchedulerConfig(max_model_len=16), CacheConfig(block_size=4, num_blocks=8))
    s.add_request(_req("a", [1, 2, 3]))
    with pytest.raises(ValueError, match="must not be empty"):
        s.add_request(_req("b", []))
    # The input processor's wording: a prompt must leave room for one generated token.
    msg = r"maximum context length is 16 tokens. However, you requested 17 tokens \(16 in the messages, 1 in"
    with pytest.raises(ValueError, match=msg):
        s.add_request(_req("c", list(range(16))))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(_req("a", [4, 5]))
    assert list(s.requests) == ["a"] and s.get_num_unfinished_requests() == 1
    s.add_request(_req("d", list(range(15))))  # max_model_len - 1 is fine


def test_duplicate_id_allowed_after_finish():
    h = Harness()
    h.add("a", [1, 2, 3], max_tokens=2)
    h.run()
    assert h.finished["a"].finish_reason == "length"
    h.add("a", [4, 5, 6], max_tokens=2)
    h.run()
    assert h.delivered["a"] == h.expected_tokens("a", 2)


@pytest.mark.parametrize("is_async", [False, True])
def test_chunked_prefill_and_cached_request_data(is_async):
    h = Harness(is_async=is_async, budget=5, depth=1)
    r = h.add("r", list(range(10, 22)), max_tokens=3)  # 12 tokens: chunks 5, 5, 2
    so1 = h.schedule()
    assert so1.num_scheduled_tokens == {"r": 5} and r.is_prefill_chunk and r.num_output_placeholders == 0
    (new,) = so1.scheduled_new_reqs
    assert new.num_computed_tokens == 0 and len(new.block_ids) == 2
    assert h.process() == []
    so2 = h.schedule()
    c = so2.scheduled_cached_reqs
    assert c.req_ids == ["r"] and c.num_computed_tokens == [5] and c.num_output_tokens == [0]
    assert c.new_block_ids == [[3]] and "r" not in c.all_token_ids  # scheduled in the previous step
    h.process()
    so3 = h.schedule()
    assert so3.num_scheduled_tokens == {"r": 2} and not r.is_prefill_chunk
    assert r.num_output_placeholders == (1 if is_async else 0)
    (o,) = h.process()
    assert len(o.new_token_ids) == 1
    so4 = h.schedule()
    assert so4.scheduled_cached_reqs.num_computed_tokens == [12]
    assert so4.scheduled_cached_reqs.num_output_tokens == [1]


def test_check_stop_order_and_reasons():
    h = Harness(is_async=False)
    h.add("min", [5, 6], max_tokens=6, eos_at=1, min_tokens=2)  # EOS at 1 ignored below min_tokens
    h.add("ign", [5, 6], max_tokens=3, eos_at=2, ignore_eos=True)
    stop_tok = h.model.token("sti", 1)
    h.add("sti", [5, 6], max_tokens=6, stop_token_ids=[stop_tok])
    h.add("eos_at_max", [5, 6], max_tokens=3, eos_at=3)
    h.run()
    assert h.finished["min"].finish_reason == "length" and h.delivered["min"][0] == EOS
    assert h.finished["ign"].finish_reason == "length" and h.delivered["ign"][1] == EOS
    assert h.finished["sti"].finish_reason == "stop" and h.finished["sti"].stop_reason == stop_tok
    assert h.delivered["sti"] == h.expected_tokens("sti", 2)
    assert h.finished["eos_at_max"].finish_reason == "stop" and h.finished["eos_at_max"].stop_reason is None


def test_min_tokens_ignores_eos_inside():
    h = Harness(is_async=True)
    h.add("m", [5, 6, 7], max_tokens=5, eos_at=2, min_tokens=3)
    h.model.eos_at["m"] = 2
    h.run()
    assert h.delivered["m"][1] == EOS and len(h.delivered["m"]) == 5


def test_max_model_len_caps_length():
    h = Harness(is_async=True, max_model_len=10)
    h.add("r", list(range(20, 26)), max_tokens=None)
    h.run()
    assert len(h.delivered["r"]) == 4 and h.finished["r"].finish_reason == "length"
    assert h.sched.num_wasted_request_steps == 0


def test_token_by_token_stop_truncates():
    s = Scheduler(SchedulerConfig(), CacheConfig(block_size=4, num_blocks=16))
    s.add_request(_req("r", [1, 2, 3], max_tokens=10, logprobs=1))
    so = s.schedule()
    token_logprobs = [TokenLogprobs([t], [-0.5], 1) for t in (7, EOS, 9)]
    (o,) = s.update_from_output(so, ModelRunnerOutput(["r"], [[7, EOS, 9]], logprobs={"r": token_logprobs}))
    assert o.new_token_ids == [7, EOS] and o.finish_reason == "stop"
    assert o.new_logprobs == token_logprobs[:2]


def test_num_cached_tokens_on_first_output_only():
    h = Harness(is_async=True)
    prompt = list(range(30, 42))  # 12 tokens, 3 blocks of 4
    h.add("a", prompt, max_tokens=2)
    h.run()
    h.add("b", prompt + [99], max_tokens=3)
    h.run()
    firsts = [o for o in h.outputs if o.request_id == "b"]
    assert firsts[0].num_cached_tokens == 12 and all(o.num_cached_tokens == 0 for o in firsts[1:])
    assert h.sched.kv_cache_manager.prefix_cache_hits == 12
    assert h.sched.kv_cache_manager.prefix_cache_queries == 12 + 13


def test_finished_ids_shipped_in_next_output_and_sets_replaced():
    h = Harness(is_async=True)
    h.add("a", [1, 2, 3], max_tokens=8, eos_at=1)
    h.add("b", [4, 5, 6], max_tokens=8)
    so1 = h.schedule()
    h.schedule()
    h.process()  # a stops on EOS
    assert so1.finished_req_ids == set()
    so3 = h.schedule()
    assert so3.finished_req_ids == {"a"}
    h.sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert so3.finished_req_ids == {"a"}, "an output's set must never be mutated afterwards"
    so4 = h.schedule()
    assert so4.finished_req_ids == {"b"}


@pytest.mark.parametrize("is_async", [False, True])
def test_abort_while_in_flight_emits_nothing_and_discards(is_async):
    h = Harness(is_async=is_async, depth=2)
    h.add("a", [1, 2, 3], max_tokens=20)
    h.add("b", [4, 5, 6], max_tokens=4)
    h.schedule()
    h.schedule()
    h.process()
    free_before = h.sched.kv_cache_manager.num_free_blocks
    h.sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert "a" not in h.sched.requests and h.sched.kv_cache_manager.num_free_blocks > free_before
    outs = h.process()
    assert all(o.request_id != "a" for o in outs)
    assert h.sched.num_wasted_request_steps == (1 if is_async else 0)  # sync never double-schedules
    h.sched.finish_requests(["a", "zzz"], RequestStatus.FINISHED_ABORTED)  # ignored
    h.run()
    assert "a" not in h.finished and h.delivered["b"] == h.expected_tokens("b", 4)


def test_abort_waiting_request():
    h = Harness(max_num_seqs=1)
    h.add("a", [1, 2, 3], max_tokens=3)
    h.add("b", [4, 5, 6], max_tokens=3)
    h.schedule()
    h.sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert h.sched.get_num_unfinished_requests() == 1
    h.run()
    assert set(h.finished) == {"a"}


def test_all_token_ids_sent_when_not_scheduled_in_previous_step():
    h = Harness(is_async=False, budget=3)
    h.add("a", [1, 2, 3], max_tokens=5)
    h.add("b", [4, 5, 6], max_tokens=5)
    h.schedule()  # a: 3 tokens, budget spent
    h.process()
    so2 = h.schedule()  # a decodes (1), b prefills 2
    assert "a" not in so2.scheduled_cached_reqs.all_token_ids
    h.run()
    assert h.delivered["a"] == h.expected_tokens("a", 5)
    assert h.delivered["b"] == h.expected_tokens("b", 5)


def test_get_grammar_bitmask_none_without_structured_output():
    h = Harness()
    h.add("a", [1, 2, 3])
    so = h.schedule()
    assert h.sched.get_grammar_bitmask(so) is None
    assert not so.has_structured_output_requests and not so.pending_structured_output_tokens


def test_max_num_seqs_and_budget_respected():
    h = Harness(max_num_seqs=2, budget=5)
    for i in range(4):
        h.add(f"r{i}", [i + 1] * 4, max_tokens=3)
    so = h.schedule()
    assert len(h.sched.running) <= 2 and so.total_num_scheduled_tokens <= 5
    h.run()
    assert all(len(h.delivered[f"r{i}"]) == 3 for i in range(4))


def test_debug_invariants_catch_out_of_order_updates():
    s = AsyncScheduler(SchedulerConfig(debug_invariants=True), CacheConfig(block_size=4, num_blocks=16))
    s.add_request(_req("r", [1, 2, 3], max_tokens=4))
    so1 = s.schedule()
    so2 = s.schedule()
    with pytest.raises(AssertionError, match="FIFO"):
        s.update_from_output(so2, ModelRunnerOutput(["r"], [[5]]))
    s.update_from_output(so1, ModelRunnerOutput(["r"], [[5]]))


def test_head_of_line_blocking_in_waiting_queue():
    h = Harness(block_size=4, num_blocks=6)  # 5 usable blocks
    h.add("a", [1] * 8, max_tokens=8)  # 2 blocks now, up to 4
    h.add("big", [2] * 16, max_tokens=2)  # 4 blocks: does not fit next to a
    h.add("small", [3] * 3, max_tokens=2)  # would fit, but waits behind big
    so = h.schedule()
    assert set(so.num_scheduled_tokens) == {"a"}
    h.run()
    assert [o.request_id for o in h.outputs if o.finish_reason][:1] == ["a"]
    assert set(h.finished) == {"a", "big", "small"}


def test_no_admission_in_a_step_that_preempted():
    h = Harness(block_size=4, num_blocks=5, budget=64, is_async=True)
    h.add("a", [1] * 4, max_tokens=10)
    h.add("b", [2] * 4, max_tokens=10)
    for _ in range(200):
        before = h.sched.num_preemptions
        if h.sched.has_requests():
            if h.sched.num_preemptions == 0 and "c" not in h.sched.requests and h.sched.current_step == 3:
                h.add("c", [3], max_tokens=2)  # fits in the block the preemption frees
            so = h.schedule()
            if h.sched.num_preemptions > before:
                assert h.sched.requests["c"].status == RequestStatus.WAITING
                assert h.sched.kv_cache_manager.num_free_blocks >= 1  # c would have fitted
                assert not so.scheduled_new_reqs and "c" not in so.num_scheduled_tokens
                break
            if len(h.in_flight) < h.depth:
                continue
        h.process()
    else:
        raise AssertionError("no preemption")
    h.run()
    assert set(h.finished) == {"a", "b", "c"}


def test_long_prefill_threshold_caps_chunks():
    h = Harness(budget=64)
    h.sched.scheduler_config.long_prefill_token_threshold = 5
    h.add("r", list(range(10, 22)), max_tokens=2)
    assert h.schedule().num_scheduled_tokens == {"r": 5}
    assert h.schedule().num_scheduled_tokens == {"r": 5}
    assert h.schedule().num_scheduled_tokens == {"r": 2}
    h.run()
    assert h.delivered["r"] == h.expected_tokens("r", 2)


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    h = Harness(budget=8, max_model_len=8, chunked=False, is_async=False)
    h.add("a", [1] * 5, max_tokens=2)
    h.add("b", [2] * 5, max_tokens=2)
    so = h.schedule()
    assert so.num_scheduled_tokens == {"a": 5}  # b (5) does not fit the remaining 3: not chunked
    h.process()
    so = h.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 5}
    h.run()
    assert set(h.finished) == {"a", "b"}
