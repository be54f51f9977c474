"""--tool-call-parser qwen3_coder (and its alias qwen3_xml) on what Qwen3-Coder writes, streamed in every
split and whole, values typed by the functions' schemas, and on what its chat template writes back when
the calls return next turn."""

from __future__ import annotations

import pytest

from stepahead.entrypoints.openai.tool_calling.parsers import TOOL_PARSERS
from stepahead.entrypoints.openai.tool_calling.parsers.typed_values import typed_value
from stepahead.entrypoints.openai.tool_calling.tools import plan_tools
from tests.entrypoints.openai import tool_parser_checks as checks

SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "threshold": {"type": "number"},
    "exact": {"type": "boolean"}, "filters": {"type": "object"}, "tags": {"type": "array"},
    "after": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "page": {"type": ["integer", "null"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
FUNCTIONS = plan_tools([SEARCH, TIME], "auto", None, auto_enabled=True).functions
ASK = {"role": "user", "content": "Find the two newest posts about <b>tags</b>, then the time."}

# As the template's instructions show it: a block per call, each value alone on its lines.
OUTPUT = ("I will search first.\n\n<tool_call>\n<function=search>\n<parameter=query>\nnewest posts\nabout <b>\n"
          "</parameter>\n<parameter=limit>\n2\n</parameter>\n<parameter=threshold>\n0.5\n</parameter>\n"
          "<parameter=exact>\nfalse\n</parameter>\n<parameter=filters>\n{\"lang\": \"en\"}\n</parameter>\n"
          "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=after>\nnull\n</parameter>\n"
          "<parameter=page>\nNone\n</parameter>\n<parameter=unknown>\n7\n</parameter>\n</function>\n"
          "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
EXPECTED = [("search", {"query": "newest posts\nabout <b>", "limit": 2, "threshold": 0.5, "exact": False,
                        "filters": {"lang": "en"}, "tags": ["a", "b"], "after": None, "page": None,
                        "unknown": "7"}),
            ("get_time", {})]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_folder):
    return checks.family_tokenizer(tokenizer_folder, added=["<tool_call>", "</tool_call>"])


@pytest.mark.parametrize("parser", ["qwen3_coder", "qwen3_xml"])
def test_calls_typed_by_the_schemas(tokenizer, parser):
    assert TOOL_PARSERS[parser] is TOOL_PARSERS["qwen3_coder"]
    content, calls = checks.read(parser, OUTPUT, FUNCTIONS, tokens=checks.token_pieces(tokenizer, OUTPUT))
    assert (content, calls) == ("I will search first.\n\n", EXPECTED)


def test_bare_functions_and_a_missing_end_read_as_vllm_reads_them():
    bare = "<function=get_time>\n</function>"
    assert checks.read("qwen3_coder", bare, FUNCTIONS) == (None, [("get_time", {})])
    unclosed = "<tool_call>\n<function=search>\n<parameter=limit>\n3\n</parameter>\n"
    assert checks.read("qwen3_coder", unclosed, FUNCTIONS) == (None, [("search", {"limit": 3})])
    open_value = "<tool_call>\n<function=search>\n<parameter=query>\nx\n</function>\n</tool_call>"
    assert checks.read("qwen3_coder", open_value, FUNCTIONS) == (None, [("search", {"query": "x"})])


@pytest.mark.parametrize("text", ["No tools needed.", "a < b <tool_cal", "x <tool_call>\nthinking aloud",
                                  "<function"])
def test_what_holds_no_call_is_content(text):
    assert checks.read("qwen3_coder", text, FUNCTIONS) == (text, [])


@pytest.mark.parametrize("value, schema, typed", [
    ("12", {"type": "integer"}, 12), ("twelve", {"type": "integer"}, "twelve"), ("2.0", {"type": "number"}, 2),
    ("1e400", {"type": "number"}, "1e400"), ("True", {"type": "boolean"}, True), ("yes", {"type": "boolean"}, False),
    ("null", {"type": "string"}, "null"), ("None", {"type": ["string", "null"]}, None),
    ("{'a': (1, 2)}", {"type": "object"}, {"a": [1, 2]}), ("{1, 2}", {"type": "array"}, "{1, 2}"),
    ("[1, 2]", {}, "[1, 2]"), ("(1, 2)", {"type": "tuple"}, [1, 2]), ("plain", None, "plain"),
])
def test_typed_values(value, schema, typed):
    assert typed_value(value, schema) == typed


def test_reads_what_the_template_writes(tokenizer):
    calls = checks.calls_of("qwen3_coder", OUTPUT, FUNCTIONS)
    turn = checks.assistant_turn(calls, content="I will search first.")
    written = checks.template_output(tokenizer, "qwen3_coder.jinja", [ASK, turn], [SEARCH, TIME], "<|im_end|>\n")
    assert "<parameter=exact>\nFalse\n</parameter>" in written  # the template writes values with str()
    assert checks.read("qwen3_coder", written, FUNCTIONS, tokens=checks.token_pieces(tokenizer, written)) == \
        ("I will search first.\n\n", EXPECTED)
