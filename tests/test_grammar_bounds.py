"""A request's grammar is bounded before anything walks it recursively, and travels as flat text;
temperatures too small to divide by are greedy or raised; refusals quote a short prefix of the input."""

from __future__ import annotations

import json
import pickle

import msgspec
import pytest

from stepahead.grammar_bounds import MAX_JSON_NESTING, MAX_SPEC_CHARS, json_text_depth, json_value_depth
from stepahead.sampling_params import SamplingParams, StructuredOutputsParams
from stepahead.validation import MAX_QUOTED_CHARS, InvalidInputError


def nested_objects(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("value", [nested_objects(5), nested_arrays(40), [[1, [2, {"a": [3]}]], {}], 7, "x",
                                   {"s": "{[[[[ not brackets ]]]]} \\\" {"}])
def test_depth_of_a_value_and_of_its_text_agree(value):
    assert json_value_depth(value) == json_text_depth(json.dumps(value))


def test_depth_counts_stop_past_the_limit():
    # A value thousands of levels deep is measured without recursion, and only to just past the limit.
    deep: list = []
    for _ in range(20_000):
        deep = [deep]
    assert json_value_depth(deep) == MAX_JSON_NESTING + 1


@pytest.mark.parametrize("schema", [nested_objects(250), nested_arrays(900), json.dumps(nested_objects(250))])
def test_a_schema_nested_past_the_limit_is_refused_naming_it(schema):
    with pytest.raises(InvalidInputError, match=f"more than {MAX_JSON_NESTING} deep") as raised:
        StructuredOutputsParams(json=schema)
    assert raised.value.param == "structured_outputs"


@pytest.mark.parametrize("kwargs, what", [
    ({"json": {"enum": ["x" * MAX_SPEC_CHARS]}}, "JSON schema"),
    ({"regex": "a" * (MAX_SPEC_CHARS + 1)}, "regex"),
    ({"grammar": "root ::= " + '"a" ' * MAX_SPEC_CHARS}, "grammar"),
    ({"choice": ["y" * 1000] * (MAX_SPEC_CHARS // 1000 + 1)}, "choice list"),
])
def test_a_spec_longer_than_the_limit_is_refused_naming_it(kwargs, what):
    with pytest.raises(InvalidInputError, match=f"the {what} has .* characters, more than the limit"):
        StructuredOutputsParams(**kwargs)


def test_a_schema_travels_as_its_text():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=nested_objects(60)))
    assert params.structured_outputs.json == json.dumps(nested_objects(60))
    # What the engine's messages and the worker's pipe do to it: both flat, however deep the schema.
    assert pickle.loads(pickle.dumps(params)) == params
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params


@pytest.mark.parametrize("temperature, expected", [(1e-45, 0.0), (5e-324, 0.0), (9e-6, 0.0), (1e-4, 0.01),
                                                   (0.005, 0.01), (0.01, 0.01), (0.7, 0.7)])
def test_tiny_temperatures_are_greedy_or_raised_to_a_safe_one(temperature, expected):
    params = SamplingParams(temperature=temperature)
    assert params.temperature == expected
    assert params.is_greedy == (expected == 0.0)


def test_a_refusal_quotes_a_short_prefix_of_the_input():
    with pytest.raises(InvalidInputError) as raised:
        SamplingParams(stop=["x" * 1000] * 999 + [""])
    message = str(raised.value)
    assert len(message) < MAX_QUOTED_CHARS + 200 and "(1003000 characters)" in message, message
