"""EngineCore over the scripted executor: step functions, waste, aborts, failures, stats, traces."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepahead.engine.core import EngineDeadError
from stepahead.sampling_params import StructuredOutputsParams
from stepahead.tracing import TraceEvent
from tests.engine.fake_executor import EOS, make_engine, request, run_to_completion

MODES = [(False, 1), (True, 2), (True, 3), (False, 2)]


def _workload(core, executor, n=6):
    model = executor.worker.model
    shared = list(range(100, 113))
    for i in range(n):
        rid = f"r{i}"
        if i % 3 == 0:
            model.eos_at[rid] = 2 + i
        core.add_request(request(rid, shared + [i] * (i + 1), max_tokens=5 + 2 * i))
    return {f"r{i}": (2 + i if i % 3 == 0 else 0, 5 + 2 * i) for i in range(n)}


@pytest.mark.parametrize("mode", MODES)
def test_identical_token_streams_across_modes(mode):
    is_async, depth = mode
    core, ex = make_engine(async_scheduling=is_async, depth=depth, num_blocks=20, budget=16)
    plan = _workload(core, ex)
    tokens, reasons = run_to_completion(core)
    core.shutdown()
    for rid, (eos_at, max_tokens) in plan.items():
        n = eos_at or max_tokens
        assert tokens[rid] == [ex.worker.model.token(rid, j) for j in range(n)], rid
        assert reasons[rid] == ("stop" if eos_at else "length")
    stats = core.get_stats()
    assert stats.finished_by_reason == {"stop": 2, "length": 4}
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_wasted_request_steps_per_eos_finish(depth):
    core, ex = make_engine(async_scheduling=depth > 1, depth=depth, eos_at={"a": 3, "b": 1, "c": 6})
    for rid in "abc":
        core.add_request(request(rid, [7, 8, 9, 10, 11], max_tokens=20))
    core.add_request(request("len", [5, 6], max_tokens=4))
    tokens, reasons = run_to_completion(core)
    core.shutdown()
    assert reasons == {"a": "stop", "b": "stop", "c": "stop", "len": "length"}
    assert core.get_stats().wasted_request_steps == 3 * (depth - 1)


@pytest.mark.parametrize("depth", [2, 3])
def test_length_finishes_waste_nothing(depth):
    core, ex = make_engine(depth=depth)
    for i in range(4):
        core.add_request(request(f"r{i}", [3 + i] * 7, max_tokens=1 + i))
    tokens, reasons = run_to_completion(core)
    core.shutdown()
    assert set(reasons.values()) == {"length"}
    assert core.get_stats().wasted_request_steps == 0


def test_step_n_plus_1_launched_while_step_n_in_flight():
    core, ex = make_engine(depth=2, hold_s=0.5)
    core.add_request(request("a", [1, 2, 3], max_tokens=6))
    run_to_completion(core)
    core.shutdown()
    assert ex.overlapped >= 5  # every decode step's sampling saw the next step already submitted


@pytest.mark.parametrize("mode", MODES)
def test_abort_while_in_flight(mode):
    is_async, depth = mode
    core, ex = make_engine(async_scheduling=is_async, depth=depth)
    core.add_request(request("a", [1, 2, 3], max_tokens=30))
    core.add_request(request("b", [4, 5, 6], max_tokens=6))
    seen: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(4):
        for o in core.step():
            seen[o.request_id].extend(o.new_token_ids)
    in_flight = bool(core.batch_queue)
    core.abort_requests(["a"])
    assert ("a" in core.scheduler.requests) == in_flight  # queued only while a step is in flight
    n_a = len(seen["a"])
    while core.has_work():
        for o in core.step():
            assert o.request_id != "a", "no output for an aborted request"
            seen[o.request_id].extend(o.new_token_ids)
    core.shutdown()
    assert seen["b"] == [ex.worker.model.token("b", j) for j in range(6)]
    assert len(seen["a"]) == n_a and "a" not in core.scheduler.requests
    assert core.get_stats().finished_by_reason.get("abort") == 1


def test_abort_from_another_thread():
    core, ex = make_engine(depth=2, step_delay_s=0.001)
    for i in range(4):
        core.add_request(request(f"r{i}", [i + 1] * 5, max_tokens=200))
    t = threading.Thread(target=core.abort_requests, args=(["r1", "r3"],))
    outs = core.step() + core.step()
    t.start()
    tokens, reasons = run_to_completion(core)
    t.join()
    core.shutdown()
    assert "r1" not in reasons and "r3" not in reasons and reasons == {"r0": "length", "r2": "length"}
    assert outs == [] or all(o.request_id for o in outs)


@pytest.mark.parametrize("mode", [(False, 1), (True, 2), (True, 3)])
def test_executor_failure_kills_engine_with_error_outputs(mode):
    is_async, depth = mode
    core, ex = make_engine(async_scheduling=is_async, depth=depth, fail_at_step=4)
    for i in range(3):
        core.add_request(request(f"r{i}", [i + 1] * 3, max_tokens=10))
    with pytest.raises(EngineDeadError, match="scripted worker failure") as err:
        for _ in range(50):
            core.step()
    assert sorted(o.request_id for o in err.value.outputs) == ["r0", "r1", "r2"]
    assert all(o.finish_reason == "error" for o in err.value.outputs)
    with pytest.raises(EngineDeadError, match="scripted worker failure"):
        core.step()
    with pytest.raises(EngineDeadError):
        core.add_request(request("late", [1, 2]))
    assert not core.has_work() and core.get_stats().finished_by_reason["error"] == 3
    core.shutdown()


def test_bad_request_changes_nothing():
    core, ex = make_engine(max_model_len=16)
    core.add_request(request("a", [1, 2, 3], max_tokens=3))
    with pytest.raises(ValueError, match="maximum context length is 16 tokens"):
        core.add_request(request("b", list(range(16))))
    with pytest.raises(ValueError, match="must not be empty"):
        core.add_request(request("c", []))
    tokens, reasons = run_to_completion(core)
    core.shutdown()
    assert reasons == {"a": "length"}


def test_stats_and_traces():
    core, ex = make_engine(depth=2, trace=True, num_blocks=12, block_size=4)
    core.add_request(request("c", [9] * 8, max_tokens=16))
    core.add_request(request("d", [8] * 8, max_tokens=16))
    run_to_completion(core)  # 2 x 6 blocks > 11: preemption
    prompt = list(range(50, 62))
    core.add_request(request("a", prompt, max_tokens=4))
    run_to_completion(core)
    core.add_request(request("b", prompt + [1], max_tokens=4))
    run_to_completion(core)
    s = core.get_stats()
    core.shutdown()
    assert s.forward_steps > 0 and s.busy_s > 0 and s.wall_s > 0
    assert s.prefix_cache_hits >= 12 and s.prefix_cache_queries >= 12 + 13 + 16
    assert s.prompt_tokens == 12 + 13 + 16 and s.generation_tokens == 40
    assert s.preemptions > 0 and s.num_total_blocks == 11 and s.num_free_blocks == 11
    events = core.drain_trace_events()
    assert all(isinstance(e, TraceEvent) for e in events)
    assert {"schedule", "update_from_output", "sample_tokens"} <= {e.name for e in events}
    assert {e.lane for e in events} == {"engine", "worker"}
    assert core.drain_trace_events() == []


def test_structured_output_defers_sampling_but_keeps_tokens():
    core, ex = make_engine(depth=2)
    core.add_request(request("s", [1, 2, 3], max_tokens=5, structured_outputs=StructuredOutputsParams(regex="a+")))
    core.add_request(request("p", [4, 5, 6], max_tokens=5))
    logged = []
    update = core.scheduler.update_from_output

    def logging_update(so, out):
        logged.append(("update", so.step_id))
        ex.log.append(("update", so.step_id))
        return update(so, out)

    core.scheduler.update_from_output = logging_update
    tokens, reasons = run_to_completion(core)
    core.shutdown()
    assert tokens["s"] == [ex.worker.model.token("s", j) for j in range(5)]
    assert tokens["p"] == [ex.worker.model.token("p", j) for j in range(5)]
    # A deferred step: its forward pass starts, the previous step is processed, then it samples.
    kinds = [k for k, _ in ex.log]
    assert any(kinds[i:i + 3] == ["execute", "update", "sample"] for i in range(len(kinds) - 2))


def test_empty_step_carries_finished_ids():
    core, ex = make_engine(depth=1, async_scheduling=False, eos_at={"a": 1})
    core.add_request(request("a", [1, 2], max_tokens=4))
    assert [o.new_token_ids for o in core.step()] == [[EOS]]
    assert core.has_work()  # one more (empty) step ships finished_req_ids to the worker
    assert core.step() == []
    assert not core.has_work() and "a" not in ex.worker.states
    core.shutdown()


def test_reset_prefix_cache_mid_run_keeps_token_streams():
    core, ex = make_engine(depth=2)
    for i in range(3):
        core.add_request(request(f"r{i}", [i + 1] * 9, max_tokens=10))
    tokens: dict[str, list[int]] = {}
    for _ in range(6):
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert core.reset_prefix_cache(reset_running_requests=True)
    rest, reasons = run_to_completion(core)
    core.shutdown()
    for rid, toks in rest.items():
        tokens.setdefault(rid, []).extend(toks)
    for i in range(3):
        assert tokens[f"r{i}"] == [ex.worker.model.token(f"r{i}", j) for j in range(10)]
    assert core.get_stats().preemptions == 3


@settings(max_examples=25, deadline=None)
@given(mode=st.sampled_from(MODES), seed=st.integers(0, 10_000),
       n=st.integers(1, 6), num_blocks=st.integers(12, 40), budget=st.integers(4, 32),
       num_spec_tokens=st.sampled_from([0, 0, 3]))
def test_engine_token_streams_property(mode, seed, n, num_blocks, budget, num_spec_tokens):
    """Random workloads under tight pools, with or without random drafts: every request gets exactly its
    scripted tokens."""
    is_async, depth = mode
    rng = random.Random(seed)
    core, ex = make_engine(async_scheduling=is_async, depth=depth, num_blocks=num_blocks, budget=budget,
                           max_model_len=40, num_spec_tokens=num_spec_tokens, draft_seed=seed)
    plan = {}
    for i in range(n):
        rid = f"q{i}"
        plen, max_tokens, eos_at = rng.randint(1, 20), rng.randint(1, 15), rng.choice([0, 0, 1, 3, 7])
        ex.worker.model.eos_at[rid] = eos_at
        core.add_request(request(rid, [rng.randint(3, 6) for _ in range(plen)], max_tokens=max_tokens))
        plan[rid] = (eos_at, max_tokens)
    tokens, reasons = run_to_completion(core)
    core.shutdown()
    for rid, (eos_at, max_tokens) in plan.items():
        n_tok = eos_at if eos_at and eos_at <= max_tokens else max_tokens
        assert tokens[rid] == [ex.worker.model.token(rid, j) for j in range(n_tok)]
        assert reasons[rid] == ("stop" if eos_at and eos_at <= max_tokens else "length")
    assert core.get_stats().num_free_blocks == num_blocks - 1
