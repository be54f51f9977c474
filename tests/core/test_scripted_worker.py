"""The scripted worker must catch a scheduler that disagrees with it (so the other tests can fail)."""

from __future__ import annotations

import pytest

from stepahead.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from stepahead.sampling_params import SamplingParams
from stepahead.tools.scripted_worker import ScriptedModel, ScriptedWorker, WorkerStateError


def _new(rid, prompt, blocks):
    return NewRequestData(rid, prompt, SamplingParams(), blocks, 0)


def _so(new=(), cached=None, sched=None, step=1):
    sched = sched or {}
    return SchedulerOutput(list(new), cached or CachedRequestData(), sched, sum(sched.values()), set(),
                           step_id=step)


def _step(w, so):
    assert w.execute_model(so) is None
    return w.sample_tokens(None)


def test_shared_block_corrupts_kv_and_is_caught():
    """Two requests handed the same block: b's prompt overwrites a's KV, and a's sampling sees it."""
    w = ScriptedWorker(ScriptedModel(), block_size=4, num_blocks=8)
    with pytest.raises(WorkerStateError, match="KV at position 0"):
        _step(w, _so([_new("a", [5, 6, 7], [1]), _new("b", [8, 9, 10], [1])], sched={"a": 3, "b": 3}))


def test_unfillable_placeholder_is_caught():
    w = ScriptedWorker(ScriptedModel(), block_size=4, num_blocks=8)
    with pytest.raises(WorkerStateError, match="placeholder it cannot fill"):
        _step(w, _so([_new("a", [5, 6, 7], [1, 2])], sched={"a": 4}))


def test_history_disagreement_is_caught():
    w = ScriptedWorker(ScriptedModel(), block_size=4, num_blocks=8)
    out = _step(w, _so([_new("a", [5, 6, 7], [1])], sched={"a": 3}))
    token_id = out.sampled_token_ids[0][0]
    wrong = CachedRequestData(["a"], all_token_ids={"a": [5, 6, 7, token_id + 1]}, new_block_ids=[None],
                              num_computed_tokens=[3], num_output_tokens=[1])
    with pytest.raises(WorkerStateError, match="disagrees"):
        w.execute_model(_so(cached=wrong, sched={"a": 1}, step=2))


def test_computed_count_disagreement_is_caught():
    w = ScriptedWorker(ScriptedModel(), block_size=4, num_blocks=8)
    _step(w, _so([_new("a", [5, 6, 7], [1])], sched={"a": 3}))
    off = CachedRequestData(["a"], new_block_ids=[None], num_computed_tokens=[2], num_output_tokens=[1])
    with pytest.raises(WorkerStateError, match="worker computed 3"):
        w.execute_model(_so(cached=off, sched={"a": 1}, step=2))


def _so_drafts(sched, drafts, computed, num_output, step):
    cached = CachedRequestData(["a"], new_block_ids=[None], num_computed_tokens=[computed], num_output_tokens=[num_output])
    so = _so(cached=cached, sched=sched, step=step)
    so.scheduled_spec_decode_tokens = drafts
    return so


def test_drafts_other_than_proposed_are_caught():
    w = ScriptedWorker(ScriptedModel(), block_size=4, num_blocks=8, num_speculative_tokens=2)
    out = _step(w, _so([_new("a", [5, 6, 7], [1, 2])], sched={"a": 3}))
    proposed = out.draft_token_ids["a"]
    assert len(proposed) == 2
    with pytest.raises(WorkerStateError, match="not the proposed"):
        w.execute_model(_so_drafts({"a": 3}, {"a": [proposed[0], proposed[1] + 1]}, 3, 1, 2))
    with pytest.raises(WorkerStateError, match="3 drafts scheduled, 2 proposed"):
        w.execute_model(_so_drafts({"a": 4}, {"a": [-1, -1, -1]}, 3, 1, 2))


def test_rejections_roll_back_and_the_scheduler_gap_is_checked():
    model = ScriptedModel()
    w = ScriptedWorker(model, block_size=4, num_blocks=8, num_speculative_tokens=2)
    _step(w, _so([_new("a", [5, 6, 7], [1, 2])], sched={"a": 3}))
    w.states["a"].drafts = [model.token("a", 1), 999]  # the second draft is wrong
    out = _step(w, _so_drafts({"a": 3}, {"a": [-1, -1]}, 3, 1, 2))
    assert out.sampled_token_ids == [[model.token("a", 1), model.token("a", 2)]]
    assert w.states["a"].num_computed_tokens == 5  # 6 scheduled positions, 1 rolled back
    # The scheduler, not having processed that step, counts 6 computed and 4 outputs: accepted.
    w.execute_model(_so_drafts({"a": 3}, {"a": [-1, -1]}, 6, 4, 3))
    w.sample_tokens(None)
    with pytest.raises(WorkerStateError, match="worker computed"):
        # A gap that no suffix of the recent rejections explains.
        w.execute_model(_so_drafts({"a": 1}, {}, w.states["a"].num_computed_tokens + 7, 6, 4))


def test_write_into_the_null_block_is_caught():
    """A table slot the scheduler returned as out of the window holds block 0: writing there is a bug."""
    w = ScriptedWorker(ScriptedModel(), block_size=4, num_blocks=8, sliding_window=4)
    with pytest.raises(WorkerStateError, match="null block"):
        _step(w, _so([_new("a", [5, 6, 7, 8, 9], [0, 1])], sched={"a": 5}))


def test_window_read_back_catches_an_overwritten_block_in_the_window():
    """With a window the worker reads back only the window, but all of it."""
    w = ScriptedWorker(ScriptedModel(), block_size=2, num_blocks=8, sliding_window=3)
    _step(w, _so([_new("a", [5, 6, 7, 8, 9], [1, 2, 3])], sched={"a": 5}))
    w.kv[1 * 2 + 0] = (99, 0)  # position 0: out of the window of position 5, never read
    cached = CachedRequestData(["a"], new_block_ids=[None], num_computed_tokens=[5], num_output_tokens=[1])
    _step(w, _so(cached=cached, sched={"a": 1}, step=2))
    w.kv[3 * 2 + 0] = (99, 4)  # position 4: inside the window of position 6
    cached = CachedRequestData(["a"], new_block_ids=[[4]], num_computed_tokens=[6], num_output_tokens=[2])
    with pytest.raises(WorkerStateError, match="KV at position 4"):
        _step(w, _so(cached=cached, sched={"a": 1}, step=3))
