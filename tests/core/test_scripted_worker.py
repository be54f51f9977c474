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
