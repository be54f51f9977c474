"""A request whose grammar, sampling or output processing fails is finished with "error" and the
reason; the engine lives on and every other request gets exactly the output it gets alone.

Each test injects a failure at one stage for one marked request (the worker runs in this process, so
the stage's own function can be wrapped), runs it in a batch with unmarked requests (some with
grammars of their own), and compares those with a clean run.
"""

from __future__ import annotations

import pytest

from stepahead import SamplingParams
from stepahead.engine import output_processor
from stepahead.sampling_params import StructuredOutputsParams
from stepahead.structured_output.manager import StructuredOutputManager
from stepahead.worker import row_failures

MAX_MODEL_LEN = 128
PROMPTS = [{"prompt_token_ids": [11 + i, 12, 13, 14 + i]} for i in range(4)]
CHOICE = StructuredOutputsParams(choice=["alpha beta", "gamma", "delta epsilon zeta"])
POISON_CHOICE = StructuredOutputsParams(choice=["poison", "venom"])
POISON_TEMPERATURE = 0.777  # the marked request of the sampling test


def _others() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=CHOICE),
            SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True, logprobs=2)]


def _run(llm, marked: SamplingParams):
    """The marked request (second of the batch) and the others' outputs."""
    others = _others()
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[2]]
    outs = llm.generate(prompts, [others[0], marked, others[1], others[2]], use_tqdm=False)
    return outs[1].outputs[0], [outs[i].outputs[0] for i in (0, 2, 3)]


@pytest.fixture(scope="module")
def clean(llm):
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], _others(), use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _check(llm, marked, others, clean, reason: str) -> None:
    assert marked.finish_reason == "error" and reason in str(marked.stop_reason), marked
    for got, want in zip(others, clean, strict=True):
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        if want.logprobs is not None:
            assert [sorted(d) for d in got.logprobs] == [sorted(d) for d in want.logprobs]
    assert not llm.engine_core.has_work()
    assert llm.stats().kv_cache_usage == 0.0
    # The engine still serves.
    (again,) = llm.generate(PROMPTS[0], _others()[0], use_tqdm=False)
    assert again.outputs[0].token_ids == clean[0].token_ids


def _is_poisoned(request) -> bool:
    so = request.sampling_params.structured_outputs
    return so is not None and so.choice == POISON_CHOICE.choice


def test_a_grammar_that_raises_on_a_token_fails_its_request_alone(llm, clean, monkeypatch):
    accept = StructuredOutputManager.accept_tokens

    def failing_accept(self, request, token_ids):
        if _is_poisoned(request):
            raise RuntimeError("injected matcher fault")
        return accept(self, request, token_ids)

    monkeypatch.setattr(StructuredOutputManager, "accept_tokens", failing_accept)
    marked, others = _run(llm, SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=POISON_CHOICE))
    _check(llm, marked, others, clean, "injected matcher fault")


class _BrokenMatcher:
    def is_terminated(self) -> bool:
        return False

    def fill_next_token_bitmask(self, bitmask, index) -> None:
        raise RuntimeError("injected bitmask fault")


def test_a_grammar_whose_bitmask_fails_fails_its_request_alone(llm, clean, monkeypatch):
    submit = StructuredOutputManager.submit

    def submit_broken(self, request):
        submit(self, request)
        if _is_poisoned(request):
            request.structured_output.matcher = _BrokenMatcher()

    monkeypatch.setattr(StructuredOutputManager, "submit", submit_broken)
    marked, others = _run(llm, SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=POISON_CHOICE))
    _check(llm, marked, others, clean, "injected bitmask fault")


def test_sampling_that_raises_for_one_row_fails_its_request_alone(llm, clean, monkeypatch):
    sample = row_failures.sample

    def failing_sample(logits, md):
        if md.num_random and POISON_TEMPERATURE in [round(t, 3) for t in md.temperature.tolist()]:
            raise RuntimeError("injected sampler fault")
        return sample(logits, md)

    # The batch's call and the row-by-row retry both go through the fault.
    monkeypatch.setattr(row_failures, "sample", failing_sample)
    marked, others = _run(llm, SamplingParams(max_tokens=8, temperature=POISON_TEMPERATURE, ignore_eos=True))
    _check(llm, marked, others, clean, "injected sampler fault")


def test_detokenization_that_raises_fails_its_request_alone(llm, clean, monkeypatch):
    detokenizer = output_processor.IncrementalDetokenizer
    poisoned_prompt = PROMPTS[3]["prompt_token_ids"]

    class FailingDetokenizer(detokenizer):
        def __init__(self, tokenizer, prompt_token_ids, *args):
            super().__init__(tokenizer, prompt_token_ids, *args)
            self.poisoned = list(prompt_token_ids) == poisoned_prompt

        def append(self, token_ids):
            if self.poisoned and token_ids:
                raise RuntimeError("injected detokenizer fault")
            return super().append(token_ids)

    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", FailingDetokenizer)
    marked, others = _run(llm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    _check(llm, marked, others, clean, "injected detokenizer fault")
