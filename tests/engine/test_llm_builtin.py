"""The built-in SmolLM2-135M-Instruct through LLM() with every default (mp executor, async scheduling)."""

from __future__ import annotations

import pytest

from stepahead import LLM, SamplingParams

QUESTIONS = ["What is the capital of France?", "What is 2+2?", "Say hello."]


@pytest.fixture(scope="module")
def llm():
    with LLM() as llm:
        yield llm


def _chat(llm, params):
    before = llm.stats().wasted_request_steps
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params, use_tqdm=False)
    return outs, llm.stats().wasted_request_steps - before


def test_defaults(llm):
    assert llm.config.executor == "mp" and llm.config.async_scheduling and llm.config.max_concurrent_batches == 2


def test_answers_paris_and_wastes_one_step_per_eos_finish(llm):
    outs, wasted = _chat(llm, SamplingParams(max_tokens=64, temperature=0.0))
    assert "Paris" in outs[0].outputs[0].text
    eos_finished = [o for o in outs if o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason is None]
    assert eos_finished and all(o.outputs[0].token_ids[-1] == llm.config.model_config.eos_token_id
                                for o in eos_finished)
    assert wasted == len(eos_finished)


def test_no_waste_when_all_finish_by_length(llm):
    outs, wasted = _chat(llm, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 6 for o in outs)
    assert wasted == 0
