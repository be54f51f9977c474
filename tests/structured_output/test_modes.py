"""Greedy structured outputs are the same token ids in every engine mode, and grammars cost
unconstrained requests nothing but time."""

from __future__ import annotations

import pytest

from stepahead import LLM, SamplingParams
from stepahead.sampling_params import StructuredOutputsParams as Constraint
from tests.structured_output.conftest import chat_prompt

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
CONSTRAINTS = [
    Constraint(json=PERSON),
    Constraint(regex=r"[A-Z][a-z]+ (is|was) [a-z]+\."),
    Constraint(choice=["Paris", "London", "Rome"]),
    Constraint(json_object=True),
    Constraint(grammar='root ::= "The answer is " [0-9]+ "."'),
]
QUESTIONS = ["Describe a person as JSON.", "Say something about the weather.", "What is the capital of France?",
             "Give me a JSON object about a dog.", "How many legs does a spider have?"]
PLAIN = ["Tell me a fun fact.", "What is 2 + 2?", "Name a colour."]
MAX_TOKENS = 40
KW = dict(max_model_len=256)


def _mixed_batch(llm):
    prompts = [chat_prompt(llm, q) for q in QUESTIONS + PLAIN]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=c) for c in CONSTRAINTS]
    params += [SamplingParams(temperature=0, max_tokens=MAX_TOKENS)] * len(PLAIN)
    return prompts, params


def _token_ids(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference():
    """Async scheduling, depth 2, worker process (the defaults)."""
    with LLM(**KW) as llm:
        prompts, params = _mixed_batch(llm)
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return [o.token_ids for o in outputs], [o.text for o in outputs]


def test_reference_outputs_follow_their_grammars(reference):
    _, texts = reference
    assert texts[2] in ("Paris", "London", "Rome")
    assert texts[4].startswith("The answer is ")


def test_unconstrained_requests_are_unaffected_by_grammars_in_the_batch(reference):
    """The plain requests' tokens are the same whether the batch's other requests follow grammars or run
    free: a grammar masks its own row only, and a decode token's result does not depend on the rows it
    shares a step with (they differ here once the constrained requests' outputs do)."""
    mixed, _ = reference
    with LLM(**KW) as llm:
        prompts, _ = _mixed_batch(llm)
        free = _token_ids(llm, prompts, [SamplingParams(temperature=0, max_tokens=MAX_TOKENS)] * len(prompts))
    assert free[:len(CONSTRAINTS)] != mixed[:len(CONSTRAINTS)]  # the grammars did change their own rows
    assert free[len(CONSTRAINTS):] == mixed[len(CONSTRAINTS):]


@pytest.mark.parametrize("mode", [
    dict(async_scheduling=False),
    dict(async_scheduling=True, max_concurrent_batches=3),
    dict(async_scheduling=False, max_concurrent_batches=2),
    dict(executor="uni"),
    dict(executor="uni", async_scheduling=True, max_concurrent_batches=3, debug_invariants=True),
])
def test_same_tokens_in_every_mode(reference, mode):
    with LLM(**KW, **mode) as llm:
        assert _token_ids(llm, *_mixed_batch(llm)) == reference[0]


@pytest.mark.parametrize("is_async", [True, False])
def test_same_tokens_when_preempted(reference, is_async):
    """Grammar state survives preemption: a preempted request's recomputed tokens attend through the
    decode kernel as they did before, so the tokens are those of a run with room for every request."""
    # 9 usable blocks of 16 tokens: one 128-token sequence, far fewer than the batch needs at once.
    with LLM(max_model_len=128, num_kv_blocks=10, async_scheduling=is_async, debug_invariants=True) as llm:
        assert _token_ids(llm, *_mixed_batch(llm)) == reference[0]
        assert llm.stats().preemptions > 0
