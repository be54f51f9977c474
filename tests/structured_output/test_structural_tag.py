"""structural_tag: free text, and after a trigger a structure (begin, JSON matching its schema, end),
in vLLM's legacy form and xgrammar's own, checked through xgrammar's real matcher and on the tiny
random model; a bad tag is refused with the compiler's message."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr

from stepahead import LLM, SamplingParams
from stepahead.sampling_params import StructuredOutputsParams as Constraint
from stepahead.structured_output import validate_structured_outputs
from stepahead.structured_output.compiler import GrammarCompiler
from stepahead.validation import InvalidInputError

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
LEGACY = {"structures": [{"begin": "<fn=add>", "schema": ADD, "end": "</fn>"}], "triggers": ["<fn="]}
XGRAMMAR = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<fn="],
    "tags": [{"type": "tag", "begin": "<fn=add>", "content": {"type": "json_schema", "json_schema": ADD},
              "end": "</fn>"}]}}
TAGS = [LEGACY, json.dumps(LEGACY), XGRAMMAR, json.dumps(XGRAMMAR)]


@pytest.fixture(scope="module")
def compiler(model_config, tokenizer):
    return GrammarCompiler(lambda: tokenizer, model_config.vocab_size, [model_config.eos_token_id])


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("text, taken", [
    ("no call at all", True),
    ('sum: <fn=add>{"a": 2, "b": 3}</fn> done <fn=add>{"a":1,"b":1}</fn>', True),
    ('<fn=add>{"a": 2, "b": "three"}</fn>', False),  # the schema holds between begin and end
    ('<fn=add>{"a": 2, "b": 3, "c": 4}</fn>', False),
    ('<fn=sub>{"a": 2, "b": 3}</fn>', False),  # after a trigger only a structure's begin may follow
    ('<fn=add>{"a": 2, "b": 3}', False),  # a structure must reach its end
])
def test_text_after_a_trigger_follows_a_structure(compiler, model_config, tag, text, taken):
    matcher = xgr.GrammarMatcher(compiler.compile(validate_structured_outputs(Constraint(structural_tag=tag))))
    assert (matcher.accept_string(text) and matcher.accept_token(model_config.eos_token_id)) == taken


def test_the_tiny_random_model_fills_a_tag_with_json_of_its_schema(tiny_llama):
    """A tag whose begin is forced: the random model's text between begin and end parses and validates
    (whitespace in it bounded, else the random model pads until max_tokens)."""
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<fn=add>", "end": "</fn>",
        "content": {"type": "json_schema", "json_schema": ADD, "max_whitespace_cnt": 1}}}
    # Integers are unbounded: enough tokens for their digits.
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=3, structured_outputs=Constraint(structural_tag=tag))
    with LLM(str(tiny_llama), executor="uni", max_model_len=128) as llm:
        outputs = [o.outputs[0] for o in llm.generate(["hello", "def main():"], params, use_tqdm=False)]
    finished = [out for out in outputs if out.finish_reason == "stop"]
    assert finished, [out.text for out in outputs]
    for out in finished:
        assert out.text.startswith("<fn=add>") and out.text.endswith("</fn>"), out.text
        jsonschema.validate(json.loads(out.text[len("<fn=add>"):-len("</fn>")]), ADD)


@pytest.mark.parametrize("tag, phrase", [
    ("{not json", "invalid structural tag in structured_outputs: not JSON: Expecting property name"),
    ({"type": "structural_tag", "format": {"type": "nope"}}, "Format type not recognized: nope"),
    ({"type": "structural_tag"}, "must have a format field"),
    ({"structures": [{"begin": "<a>", "schema": ADD}], "triggers": ["<a"]}, '"structures" must be a non-empty list'),
    ({"structures": [{"begin": "<a>", "schema": ADD, "end": "</a>"}], "triggers": "<a"}, '"triggers" must be'),
    ({"structures": [{"begin": "<a>", "schema": {"type": "bogus"}, "end": "</a>"}], "triggers": ["<a"]},
     'Unsupported type "bogus"'),
    ({"structures": [{"begin": "<a>", "schema": ADD, "end": "</a>"}], "triggers": ["<b"]},
     "does not match any trigger"),
])
def test_a_bad_structural_tag_is_refused_with_the_compilers_message(tag, phrase):
    with pytest.raises(InvalidInputError, match=phrase) as raised:
        validate_structured_outputs(Constraint(structural_tag=tag))
    assert raised.value.param == "structured_outputs"
    assert str(raised.value).startswith("invalid structural tag in structured_outputs: ")


def test_a_structural_tag_is_one_constraint_of_the_kinds():
    with pytest.raises(InvalidInputError, match="exactly one of json, regex, choice, grammar, json_object, "
                                                "structural_tag must be set"):
        Constraint(structural_tag=LEGACY, json=ADD)
    assert Constraint(structural_tag=LEGACY).kind == "structural_tag"
    assert Constraint(structural_tag=LEGACY).structural_tag == json.dumps(LEGACY)  # travels as its text
