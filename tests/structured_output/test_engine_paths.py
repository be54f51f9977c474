"""The engine's structured-output paths on the built-in model: deferred sampling in the trace,
termination, length, and a grammar that fails to compile."""

from __future__ import annotations

import pytest

from stepahead import LLM, SamplingParams
from stepahead.request import Request
from stepahead.sampling_params import StructuredOutputsParams as Constraint
from tests.structured_output.conftest import chat_prompt


def _by_step(events, name):
    return {e.args["step"]: e for e in events if e.name == name}


def test_trace_shows_deferred_sampling_only_with_grammars():
    with LLM(trace=True, executor="uni", max_model_len=256) as llm:
        prompts = [chat_prompt(llm, "Describe a cat."), chat_prompt(llm, "Describe a dog.")]
        plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        llm.generate(prompts, plain, use_tqdm=False)
        unconstrained = llm.drain_trace_events()
        llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                              structured_outputs=Constraint(regex="[a-z ]{80}")), plain],
                     use_tqdm=False)
        constrained = llm.drain_trace_events()

    def sampled_after_previous_processed(events) -> list[bool]:
        """Per step after the first: was its sampling submitted after the previous step was processed?"""
        samples, updates = _by_step(events, "sample_tokens"), _by_step(events, "update_from_output")
        return [samples[s].start >= updates[s - 1].end for s in sorted(samples) if s - 1 in updates]

    grammar_steps = {s for s, e in _by_step(constrained, "sample_tokens").items() if e.args["grammar"]}
    assert len(grammar_steps) >= 8
    waits = sampled_after_previous_processed(
        [e for e in constrained if e.name != "sample_tokens" or e.args["step"] in grammar_steps])
    # The prefill's sample needs no earlier token; every later grammar step waited for its predecessor.
    assert len(waits) >= 8 and all(waits[1:])
    assert not any(sampled_after_previous_processed(unconstrained))  # without grammars: no waiting


def test_grammar_ends_the_request_even_with_ignore_eos(smollm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                            structured_outputs=Constraint(choice=["yes", "no"]))
    (out,) = smollm.generate(chat_prompt(smollm, "Is water wet?"), params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in ("yes", "no")


def test_grammar_longer_than_max_tokens_ends_with_length(smollm):
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=Constraint(regex="(ab){40}"))
    (out,) = smollm.generate(chat_prompt(smollm, "Write ab many times."), params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    assert "(ab){40}".startswith("(ab)") and set(out.outputs[0].text) <= {"a", "b"}


def test_grammar_that_fails_to_compile_fails_its_request_only(smollm):
    """Past the frontend's check (a request added to the engine core directly), a compile error fails
    that request with "error" and the engine keeps serving."""
    core = smollm.engine_core
    bad = Request("bad", [1, 2, 3], SamplingParams(max_tokens=4, structured_outputs=Constraint(regex="a[")),
                  eos_token_id=2)
    core.add_request(bad)
    outputs = []
    while core.has_work():
        outputs += core.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("bad", "error")]
    assert "Unclosed" in outputs[0].stop_reason
    (out,) = smollm.generate(chat_prompt(smollm, "Hi"), SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("constraint", [Constraint(json_object=True), Constraint(grammar='root ::= "x" [0-9]')])
def test_other_grammar_kinds(smollm, constraint):
    (out,) = smollm.generate(chat_prompt(smollm, "Give me a JSON object describing a book."),
                             SamplingParams(temperature=0, max_tokens=80, structured_outputs=constraint),
                             use_tqdm=False)
    text = out.outputs[0].text
    if constraint.json_object:
        assert text.lstrip().startswith("{")
    else:
        assert out.outputs[0].finish_reason == "stop" and len(text) == 2 and text[0] == "x" and text[1].isdigit()
