"""Every spelling of a structural tag and of JSON's whitespace options becomes one StructuredOutputsParams
(no server: the request models and the conversion the handlers run); misuse names the field sent."""

from __future__ import annotations

import json

import pytest

from stepahead.entrypoints.openai.errors import APIError
from stepahead.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from stepahead.entrypoints.openai.serving_utils import structured_outputs_of
from stepahead.validation import InvalidInputError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
LEGACY = {"structures": [{"begin": "<fn=f>", "schema": SCHEMA, "end": "</fn>"}], "triggers": ["<fn="]}
FORMAT = {"type": "tag", "begin": "<fn=f>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</fn>"}
MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


@pytest.mark.parametrize("fields, tag", [
    ({"response_format": {"type": "structural_tag", **LEGACY}}, LEGACY),
    ({"response_format": {"type": "structural_tag", "format": FORMAT}}, {"type": "structural_tag", "format": FORMAT}),
    ({"structured_outputs": {"structural_tag": json.dumps(LEGACY)}}, LEGACY),
    ({"structured_outputs": {"structural_tag": LEGACY}}, LEGACY),
    ({"structural_tag": json.dumps(LEGACY)}, LEGACY),  # vLLM's older top-level spelling
])
def test_each_spelling_of_a_structural_tag(fields, tag):
    params = structured_outputs_of(_chat(**fields))
    assert params is not None and params.kind == "structural_tag" and json.loads(params.structural_tag) == tag
    completion = structured_outputs_of(CompletionRequest(prompt="hi", **fields))
    assert completion == params


@pytest.mark.parametrize("constraint", [{"json": SCHEMA}, {"json_object": True}])
def test_disable_any_whitespace_reaches_the_params(constraint):
    params = structured_outputs_of(_chat(structured_outputs={**constraint, "disable_any_whitespace": True}))
    assert params is not None and params.disable_any_whitespace and params.kind in constraint
    assert not structured_outputs_of(_chat(structured_outputs=constraint)).disable_any_whitespace


@pytest.mark.parametrize("fields, param, phrase", [
    ({"response_format": {"type": "structural_tag"}}, "response_format", "either structures and triggers"),
    ({"response_format": {"type": "structural_tag", **LEGACY, "format": FORMAT}}, "response_format", "either"),
    ({"response_format": {"type": "structural_tag", "structures": LEGACY["structures"]}}, "response_format",
     "both structures and triggers"),
    ({"structural_tag": json.dumps(LEGACY), "guided_json": SCHEMA}, "structural_tag", "exactly one of"),
    ({"structural_tag": json.dumps(LEGACY), "structured_outputs": {"json": SCHEMA}}, "structured_outputs",
     "Only one of"),
    ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}, "structured_outputs",
     "disable_any_whitespace applies to json and json_object only"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "[ ]?"}}, "structured_outputs",
     "whitespace_pattern is not supported"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]?"}, "guided_whitespace_pattern",
     "guided_whitespace_pattern is not supported"),
])
def test_misuse_names_the_field_sent(fields, param, phrase):
    with pytest.raises((APIError, InvalidInputError), match=phrase) as raised:
        structured_outputs_of(_chat(**fields))
    assert raised.value.param == param


def test_disable_any_whitespace_takes_only_a_boolean():
    with pytest.raises(ValueError, match="disable_any_whitespace"):
        _chat(structured_outputs={"json": SCHEMA, "disable_any_whitespace": "yes"})
