"""Async model-runner outputs: sample_tokens returns before the ids are read, the request states hold
-1 until the handle resolves, and the OutputResolver delivers results in call order or fails loudly."""

from __future__ import annotations

import dataclasses
import threading

from stepahead.core.sched_output import ModelRunnerOutput
from stepahead.executor.output_resolver import OutputResolver
from stepahead.worker.async_output import AsyncModelRunnerOutput
from stepahead.worker.model_runner import ModelRunner
from tests.worker.driver import MiniSched, make_config

PROMPTS = [[5, 9, 200, 31, 7], [44] * 17, list(range(3, 40))]


def _step_unresolved(sched: MiniSched) -> AsyncModelRunnerOutput:
    """One step whose output is left unresolved; the driver gets -1 placeholders, as the async scheduler."""
    assert sched.runner.execute_model(sched.build()) is None
    handle = sched.runner.sample_tokens(None)
    assert isinstance(handle, AsyncModelRunnerOutput)
    for req_id in sched.reqs:
        sched.reqs[req_id].outputs.append(-1)
    return handle


def test_placeholders_fill_on_resolve_and_match_sync(tiny_llama):
    sync = MiniSched(ModelRunner(make_config(tiny_llama)), 16)
    runner = ModelRunner(dataclasses.replace(make_config(tiny_llama), async_output=True))
    sched = MiniSched(runner, 16)
    for i, p in enumerate(PROMPTS):
        sync.add(f"r{i}", p, 5)
        sched.add(f"r{i}", p, 5)
    expected = sync.run()

    first = _step_unresolved(sched)  # the prefills
    assert all(state.token_ids[-1] == -1 for state in runner.requests.values())
    second = _step_unresolved(sched)  # one decode each, fed from the device copy of the first's tokens
    third = _step_unresolved(sched)
    # Step 3's execute_model waited for all but the newest step before it: the first, not the second.
    assert first.resolved and not second.resolved
    assert all(state.token_ids[-3] != -1 and state.token_ids[-2:] == [-1, -1] for state in runner.requests.values())
    outputs = [first.get_output(), second.get_output(), third.get_output()]
    assert all(-1 not in state.token_ids for state in runner.requests.values())
    got = {req_id: [] for req_id in sched.reqs}
    for output in outputs:
        for req_id, tokens in zip(output.req_ids, output.sampled_token_ids, strict=True):
            got[req_id] += tokens
    assert got == {req_id: tokens[:3] for req_id, tokens in expected.items()}
    assert {req_id: state.output_token_ids for req_id, state in runner.requests.items()} == got


class _Handle(AsyncModelRunnerOutput):
    """An async output released by the test, to check ordering without a GPU."""

    def __init__(self, output, release: threading.Event, error: BaseException | None = None):
        self.output, self.release, self.error = output, release, error

    def get_output(self):
        self.release.wait()
        if self.error is not None:
            raise self.error
        return self.output


def test_resolver_delivers_in_call_order():
    delivered, failures = [], []
    resolver = OutputResolver(delivered.append, failures.append)
    release = threading.Event()
    first = ModelRunnerOutput(["a"], [[1]])
    resolver.put(None)
    resolver.put(_Handle(first, release))
    resolver.put(None)  # put after the handle: must not overtake it
    resolver.put(ModelRunnerOutput.empty())
    release.set()
    resolver.close()
    assert delivered == [None, first, None, ModelRunnerOutput.empty()] and failures == []


def test_resolver_failure_stops_delivery():
    delivered, failures = [], []
    resolver = OutputResolver(delivered.append, failures.append)
    release = threading.Event()
    release.set()
    resolver.put(_Handle(None, release, RuntimeError("device lost")))
    resolver.put(ModelRunnerOutput.empty())
    resolver.close()
    assert delivered == [] and [str(e) for e in failures] == ["device lost"]
