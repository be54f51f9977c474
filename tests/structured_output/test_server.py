"""Structured outputs through the OpenAI-compatible server on the built-in model: response_format (a
structural tag too), vLLM's structured_outputs (compact JSON too) and guided_* fields, streaming, and the
offline LLM's exact error messages."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from stepahead import SamplingParams
from stepahead.models.loading.loader import builtin_model_path
from stepahead.sampling_params import StructuredOutputsParams
from tests.entrypoints.openai.server_utils import RemoteServer
from tests.structured_output.conftest import has_whitespace_outside_strings

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
ASK_ADD = [{"role": "user", "content": "Add 2 and 3 as JSON."}]


@pytest.fixture(scope="module")
def client():
    server = RemoteServer(builtin_model_path(), "--served-model-name", "x", "--max-model-len", "512",
                          "--executor", "uni")
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    server.stop()


def test_response_format_json_schema(client):
    r = client.chat.completions.create(
        model="x", messages=ASK, temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_streamed_json_schema_and_json_object(client):
    stream = client.chat.completions.create(
        model="x", messages=ASK, temperature=0, max_tokens=64, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    r = client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=8,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.lstrip().startswith("{")


def test_response_format_structural_tag(client):
    """vLLM's legacy form: the text is free, but a ```json fence the model opens holds JSON of the schema
    and is closed (free, the model writes other keys there)."""
    fence = {"begin": "```json\n", "schema": ADD, "end": "\n```"}
    r = client.chat.completions.create(
        model="x", messages=ASK_ADD, temperature=0, max_tokens=80,
        response_format={"type": "structural_tag", "structures": [fence], "triggers": ["```json"]})
    text = r.choices[0].message.content
    fenced = re.findall(r"```json\n(.*?)\n```", text, re.DOTALL)
    assert fenced and len(fenced) == text.count("```json"), text
    for part in fenced:
        jsonschema.validate(json.loads(part), ADD)


def test_structured_outputs_disable_any_whitespace(client):
    def content(compact: bool) -> str:
        r = client.chat.completions.create(model="x", messages=ASK_ADD, temperature=0, max_tokens=64, extra_body={
            "structured_outputs": {"json": ADD, "disable_any_whitespace": compact}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), ADD)
        return r.choices[0].message.content

    assert has_whitespace_outside_strings(content(False))  # the model's own layout
    assert not has_whitespace_outside_strings(content(True))


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": "[A-Z][a-z]{1,8}"}}, lambda t: t[0].isupper() and t[1:].islower()),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"guided_regex": "[0-9]{3}"}, lambda t: len(t) == 3 and t.isdigit()),
    ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
])
def test_vllm_fields_on_completions(client, extra, check):
    r = client.completions.create(model="x", prompt="My favourite colour is", temperature=0, max_tokens=64,
                                  extra_body=extra)
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize("constraint", [{"regex": "a["}, {"json": {"type": "bogus"}}, {"grammar": "root ::= ("}])
def test_offline_and_server_reject_bad_grammars_alike(client, smollm, constraint):
    with pytest.raises(ValueError) as offline:
        smollm.generate("hi", SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)), use_tqdm=False)
    with pytest.raises(openai.BadRequestError) as online:
        client.completions.create(model="x", prompt="hi", extra_body={"structured_outputs": constraint})
    assert online.value.body["message"] == str(offline.value) and online.value.body["param"] == "structured_outputs"
    assert client.completions.create(model="x", prompt="hi", max_tokens=2).choices[0].text is not None
