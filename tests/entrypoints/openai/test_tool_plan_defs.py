"""A required tool choice's schema: each function's $defs move to the root of the calls' array, where
"#/$defs/..." references resolve; xgrammar compiles it and a call matching the references validates."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar

from stepahead.entrypoints.openai.errors import APIError
from stepahead.entrypoints.openai.tool_calling.tools import plan_tools

UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}


def _tool(name: str, defs: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"], "$defs": defs}}}


def test_required_schema_hoists_defs():
    schema = plan_tools([_tool("a", {"Unit": UNIT}), _tool("b", {"Unit": UNIT})], "required", True, False).schema()
    assert schema["$defs"] == {"Unit": UNIT}
    assert all("$defs" not in call["properties"]["parameters"] for call in schema["items"]["anyOf"])
    jsonschema.validate([{"name": "a", "parameters": {"unit": "celsius"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "b", "parameters": {"unit": "kelvin"}}], schema)
    xgrammar.Grammar.from_json_schema(json.dumps(schema))  # its references resolve


def test_conflicting_defs_are_a_400_naming_tools():
    plan = plan_tools([_tool("a", {"Unit": UNIT}), _tool("b", {"Unit": {"type": "integer"}})], "required", True, False)
    with pytest.raises(APIError, match="Unit") as err:
        plan.schema()
    assert err.value.param == "tools"
