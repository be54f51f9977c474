"""Bad input raises ValueError before anything runs; a dead worker raises a clear error, never a hang."""

from __future__ import annotations

import os
import signal
import time

import pytest

from stepahead import LLM, SamplingParams
from stepahead.errors import EngineDeadError
from stepahead.sampling_params import StructuredOutputsParams
from stepahead.validation import InvalidInputError

MAX_MODEL_LEN = 64  # of the module's `llm` (tests/engine/conftest.py)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
GOOD = {"prompt_token_ids": [11, 12, 13, 14]}


@pytest.fixture(scope="module")
def expected(llm):
    (out,) = llm.generate(GOOD, PARAMS, use_tqdm=False)
    return out.outputs[0].token_ids


@pytest.mark.parametrize("bad, match", [
    ("", "prompt must not be empty"),
    ({"prompt_token_ids": []}, "prompt must not be empty"),
    ({"prompt_token_ids": [5, 2048]}, r"prompt_token_ids must be token ids in \[0, 2048\)"),
    ({"prompt_token_ids": [-1]}, r"prompt_token_ids must be token ids in \[0, 2048\)"),
    ({"prompt_token_ids": [5] * 60}, "maximum context length is 64 tokens. However, you requested 66 tokens"),
])
def test_bad_prompt_raises_and_nothing_runs(llm, expected, bad, match):
    before = llm.stats()
    with pytest.raises(ValueError, match=match):
        llm.generate([GOOD, bad, GOOD], PARAMS, use_tqdm=False)
    after = llm.stats()
    assert after.prompt_tokens == before.prompt_tokens  # nothing of the batch was added
    assert not llm.engine_core.has_work() and not llm.output_processor.has_unfinished_requests()
    (out,) = llm.generate(GOOD, PARAMS, use_tqdm=False)
    assert out.outputs[0].token_ids == expected


def test_bad_request_leaves_a_stream_in_flight_untouched(llm, expected):
    stream = llm.generate_stream(GOOD, PARAMS)
    first = next(stream)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(GOOD, SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    rest = list(stream)
    assert [t for d in [first, *rest] for t in d.outputs[0].token_ids] == expected


@pytest.mark.parametrize("constraint, match", [
    ({"regex": "a["}, r"invalid regex in structured_outputs: Regex parsing error at position 3: Unclosed '\['"),
    ({"json": {"type": "bogus"}}, 'invalid JSON schema in structured_outputs: Unsupported type "bogus"'),
    ({"json": "{not json"}, "invalid JSON schema in structured_outputs: Expecting property name"),
    ({"grammar": "root ::= "}, "invalid grammar in structured_outputs: EBNF parser error at line 1"),
])
def test_bad_grammar_raises_before_anything_is_queued(llm, expected, constraint, match):
    """The compiler's message, as a ValueError, before anything of the batch runs."""
    params = SamplingParams(max_tokens=6, structured_outputs=StructuredOutputsParams(**constraint))
    before = llm.stats()
    with pytest.raises(InvalidInputError, match=match) as raised:
        llm.generate([GOOD, GOOD], [PARAMS, params], use_tqdm=False)
    assert raised.value.param == "structured_outputs" and isinstance(raised.value, ValueError)
    assert llm.stats().prompt_tokens == before.prompt_tokens  # nothing of the batch ran
    (out,) = llm.generate(GOOD, PARAMS, use_tqdm=False)
    assert out.outputs[0].token_ids == expected


def test_bad_sampling_params_list_length(llm):
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([GOOD, GOOD], [PARAMS], use_tqdm=False)


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM("unused", max_num_seq=4)


@pytest.mark.parametrize("when", ["between_calls", "mid_generation"])
def test_killed_worker_raises_clear_error(tiny_llama, when):
    llm = LLM(str(tiny_llama), executor="mp", max_model_len=64)
    try:
        llm.generate(GOOD, PARAMS, use_tqdm=False)
        died = r"engine core died.*worker process \(pid \d+\) died unexpectedly \(killed by signal 9\)"
        # The engine's own error reaches the caller as it is (and is still a RuntimeError).
        if when == "between_calls":
            os.kill(llm._executor.worker_pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match=died) as raised:
                llm.generate([GOOD, GOOD], PARAMS, use_tqdm=False)
        else:
            stream = llm.generate_stream(GOOD, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
            next(stream)
            os.kill(llm._executor.worker_pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match=died) as raised:
                list(stream)
        assert isinstance(raised.value, RuntimeError)
        with pytest.raises(EngineDeadError, match="died earlier"):
            llm.generate(GOOD, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    with pytest.raises(RuntimeError):
        llm.generate(GOOD, PARAMS, use_tqdm=False)


def test_garbage_collection_stops_the_worker(tiny_llama):
    import gc

    llm = LLM(str(tiny_llama), executor="mp", max_model_len=64)
    llm.generate(GOOD, PARAMS, use_tqdm=False)
    proc = llm._executor._procs[0]
    del llm
    gc.collect()
    assert not proc.is_alive() and proc.exitcode == 0


def test_empty_prompt_list_and_empty_conversation(llm):
    assert llm.generate([], PARAMS, use_tqdm=False) == []
    with pytest.raises(ValueError, match="messages must be a non-empty"):
        llm.chat([], PARAMS, use_tqdm=False)


@pytest.fixture
def ctrl_c_raises():
    """Python's own SIGINT handler for the test: a suite started in the background (`make test &`)
    inherits SIGINT ignored, and then Python installs no handler and Ctrl-C raises nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_aborts_the_call_and_the_engine_lives_on(tiny_llama, ctrl_c_raises):
    """Ctrl-C reaches the worker too (same process group): it survives, the call is aborted, the LLM works."""
    with LLM(str(tiny_llama), executor="mp", max_model_len=64) as llm:
        (ref,) = llm.generate(GOOD, PARAMS, use_tqdm=False)
        stream = llm.generate_stream(GOOD, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        with pytest.raises(KeyboardInterrupt):
            for k, _ in enumerate(stream):
                if k == 2:
                    os.kill(llm._executor.worker_pid, signal.SIGINT)
                    os.kill(os.getpid(), signal.SIGINT)
                    # Let the handler run here, in this frame: at a later bytecode it could land in a
                    # finalizer (__del__, a weakref callback), where Python prints and drops it.
                    time.sleep(5)
        stream.close()  # as leaving the caller's frame would: the request is aborted
        assert not llm.output_processor.has_unfinished_requests()
        (again,) = llm.generate(GOOD, PARAMS, use_tqdm=False)
        assert again.outputs[0].token_ids == ref.outputs[0].token_ids
        assert llm._executor._procs[0].is_alive()
