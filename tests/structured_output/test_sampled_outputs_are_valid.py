"""Sampled at temperature 1.0 under random grammars, every output that finishes with "stop" is valid."""

from __future__ import annotations

import json
import random
import re

import jsonschema

from stepahead import SamplingParams
from stepahead.sampling_params import StructuredOutputsParams
from tests.structured_output.conftest import chat_prompt
from tests.structured_output.random_schemas import random_choice, random_object_schema, random_regex


def _run(llm, prompts, constraints, max_tokens):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                             structured_outputs=StructuredOutputsParams(**c)) for i, c in enumerate(constraints)]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_120_random_json_schemas(smollm):
    rng = random.Random(0)
    schemas = [random_object_schema(rng) for _ in range(120)]
    prompts = [chat_prompt(smollm, f"Reply with a JSON object with the fields {', '.join(s['properties'])}.")
               for s in schemas]
    outputs = _run(smollm, prompts, [{"json": s} for s in schemas], max_tokens=96)
    finished = [(o, s) for o, s in zip(outputs, schemas, strict=True) if o.finish_reason == "stop"]
    assert len(finished) >= 90, [o.finish_reason for o in outputs]  # most complete within max_tokens
    for out, schema in finished:
        jsonschema.validate(json.loads(out.text), schema)  # strict json.loads: no raw control characters
    assert {o.finish_reason for o in outputs} <= {"stop", "length"}


def test_random_regexes_and_choices(smollm):
    rng = random.Random(1)
    regexes = [random_regex(rng) for _ in range(60)]
    choices = [random_choice(rng) for _ in range(60)]
    prompts = [chat_prompt(smollm, "Answer with one short word or phrase.")] * 120
    outputs = _run(smollm, prompts, [{"regex": r} for r in regexes] + [{"choice": c} for c in choices],
                   max_tokens=32)
    assert sum(o.finish_reason == "stop" for o in outputs) >= 100
    for out, regex in zip(outputs[:60], regexes, strict=True):
        if out.finish_reason == "stop":
            assert re.fullmatch(regex, out.text), (regex, out.text)
    for out, choice in zip(outputs[60:], choices, strict=True):
        if out.finish_reason == "stop":
            assert out.text in choice, (choice, out.text)
