"""Grammar requests draft: each draft position is masked as plain constrained decoding masks it there, so
with drafts (suffix or n-gram, async or sync, preempted, chunked) a request gets exactly its plain
constrained output, and the JSON is valid. The built-in model copies the record in its prompt, so the
drafts hit."""

from __future__ import annotations

import json

import jsonschema
import pytest

from stepahead import LLM, SamplingParams
from stepahead.sampling_params import StructuredOutputsParams
from tests.structured_output.conftest import chat_prompt

RECORDS = [
    {"name": "Ada Lovelace", "city": "London", "year": 1815, "tags": ["math", "engines", "poetry"]},
    {"name": "Alan Turing", "city": "Wilmslow", "year": 1912, "tags": ["logic", "codes"]},
    {"name": "Grace Hopper", "city": "New York", "year": 1906, "tags": ["compilers", "navy", "cobol"]},
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                           "year": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "city", "year", "tags"], "additionalProperties": False}
CHOICES = ["the quick brown fox jumps over the lazy dog", "the lazy dog sleeps"]
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
MAX_MODEL_LEN = 256
MODES = {
    "async": dict(speculative_config=SUFFIX),
    "sync": dict(speculative_config=SUFFIX, async_scheduling=False),
    "depth3": dict(speculative_config=SUFFIX, max_concurrent_batches=3),
    "preempt": dict(speculative_config=SUFFIX, num_kv_blocks=17),
    "chunked_sync": dict(speculative_config=NGRAM, max_num_batched_tokens=32, async_scheduling=False),
}


def _requests(llm: LLM) -> tuple[list[str], list[SamplingParams]]:
    prompts = [chat_prompt(llm, f"Repeat this JSON record exactly: {json.dumps(r)}") for r in RECORDS]
    prompts.append(chat_prompt(llm, f"Say one of: {' / '.join(CHOICES)}."))
    params = [SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
              for _ in RECORDS]
    params.append(SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=CHOICES)))
    return prompts, params


def _run(**overrides):
    with LLM(max_model_len=MAX_MODEL_LEN, **overrides) as llm:
        prompts, params = _requests(llm)
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [(o.token_ids, o.text, o.finish_reason) for o in outputs], llm.stats()


@pytest.fixture(scope="module")
def plain():
    return _run()[0]


def test_plain_outputs_are_valid(plain):
    for _, text, reason in plain[:len(RECORDS)]:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert plain[-1][1] in CHOICES


@pytest.mark.parametrize("mode", list(MODES))
def test_drafted_grammar_outputs_equal_plain_ones(plain, mode):
    outputs, stats = _run(**MODES[mode])
    assert outputs == plain
    # Drafts were verified for grammar requests and most were accepted (the record is copied).
    assert stats.spec_num_accepted_tokens > 0.5 * stats.spec_num_draft_tokens > 0
    if mode == "preempt":
        assert stats.preemptions > 0
