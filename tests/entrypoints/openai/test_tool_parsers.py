"""Tool-call parsing without a server: the plan's checks and schema, and each stream fed in every split."""

from __future__ import annotations

import json

import pytest

from stepahead.entrypoints.openai.errors import APIError
from stepahead.entrypoints.openai.tool_calling.constrained import NamedToolStream, RequiredToolStream
from stepahead.entrypoints.openai.tool_calling.parsers import TOOL_PARSERS
from stepahead.entrypoints.openai.tool_calling.parsers.base import collect
from stepahead.entrypoints.openai.tool_calling.tools import plan_tools
from tests.entrypoints.openai.tool_parser_checks import streamed

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _streamed(stream, text: str, size: int) -> tuple[str, dict[int, dict]]:
    """Feed text in pieces of `size`; the content and the calls the deltas assemble."""
    return streamed(stream, [text[i:i + size] for i in range(0, len(text), size)])


HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris {x}"}}\n</tool_call>\n'
          '<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("parser, text, content", [("hermes", HERMES, "Let me check."), ("llama3_json", LLAMA, "")])
def test_parsers_stream_the_same_calls_in_any_split(parser, text, content, size):
    got_content, calls = _streamed(TOOL_PARSERS[parser](), text, size)
    assert got_content == content
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    city = json.loads(calls[0]["arguments"])["city"]
    assert city in ('Pa"ris {x}', "Oslo") and json.loads(calls[1]["arguments"]) == {}
    whole_content, whole_calls = collect(TOOL_PARSERS[parser](), text)
    assert (whole_content or "") == content
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == \
        [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("text", ["Just text, no call.", "a < b <tool_cal", "  {not json", ""])
def test_plain_text_stays_content(parser, text):
    for size in (1, 4, 100):
        content, calls = _streamed(TOOL_PARSERS[parser](), text, size)
        if not calls:
            assert content == text
    content, calls = collect(TOOL_PARSERS[parser](), text)
    assert calls == [] and (content or "") == (text if text.strip() else "")


def test_constrained_streams():
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'
    for size in (1, 5, 500):
        _, calls = _streamed(RequiredToolStream(), text, size)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
            [("get_weather", {"city": "Rome"}), ("get_time", {})]
        _, calls = _streamed(NamedToolStream("get_weather"), '{"city": "Rome"}', size)
        assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Rome"}
    assert collect(NamedToolStream("get_weather"), '{"city": "Ro') == ('{"city": "Ro', [])  # cut by max_tokens


def test_plan_schema_for_required_and_named():
    plan = plan_tools([WEATHER, TIME], "required", False, auto_enabled=False)
    schema = plan.schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None, False)
    assert named.mode == "named" and named.schema() == WEATHER["function"]["parameters"]
    assert plan_tools([WEATHER], "none", None, False).schema() is None
    assert plan_tools([WEATHER], None, None, auto_enabled=True).mode == "auto"


@pytest.mark.parametrize("tools, choice, phrase", [
    ([WEATHER, WEATHER], "required", "unique"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], "required",
     "not a valid JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "required", "object"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "required", "function.name"),
    ([{"type": "retrieval"}], "required", "function"),
    ([WEATHER], {"type": "function", "function": {"name": "absent"}}, "not in tools"),
    ([WEATHER], {"type": "function"}, "tool_choice must be"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    ([WEATHER], "auto", "--enable-auto-tool-choice"),
    ([WEATHER], None, "--enable-auto-tool-choice"),
    (None, "required", "`tools` must be set"),
])
def test_bad_tools_are_400s(tools, choice, phrase):
    with pytest.raises(APIError, match=phrase) as raised:
        plan_tools(tools, choice, None, auto_enabled=False)
    assert raised.value.status == 400 and raised.value.param in ("tools", "tool_choice")
