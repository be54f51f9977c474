"""--tool-call-parser pythonic on what Llama 3.2 and Llama 4 write (a Python list of calls), streamed in every
split and whole, and on what Llama 4's pythonic template writes back when the calls return next turn."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai import tool_parser_checks as checks

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = {"role": "user", "content": "Weather in Paris, and the time?"}

# The templates' instructions: "[func_name1(params_name1=params_value1, ...), func_name2(params)]".
OUTPUT = ('[get_weather(city="Pa\\"ris (FR)]", unit=\'celsius\', days=3, hourly=True, range=[1.5, None], '
          'opts={"a": (1, 2)}), get_time()]')
EXPECTED = [("get_weather", {"city": 'Pa"ris (FR)]', "unit": "celsius", "days": 3, "hourly": True,
                             "range": [1.5, None], "opts": {"a": [1, 2]}}), ("get_time", {})]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_folder):
    return checks.family_tokenizer(tokenizer_folder)


def test_calls_with_literal_arguments(tokenizer):
    assert checks.read("pythonic", OUTPUT, tokens=checks.token_pieces(tokenizer, OUTPUT)) == (None, EXPECTED)
    assert checks.read("pythonic", "\n " + OUTPUT + "\n") == (None, EXPECTED)


def test_a_call_that_is_not_literal_ends_the_list():
    """The calls before it stand; without any, the output is content."""
    assert checks.read("pythonic", "[get_time(), get_weather(city=paris)]") == (None, [("get_time", {})])
    for text in ("[get_weather(city=paris)]", '[get_weather("Paris")]', "[get_weather(**kw)]",
                 "[get_weather(city={1, 2})]", "[get_weather(city=1 + 2)]"):
        assert checks.read("pythonic", text) == (text, [])


@pytest.mark.parametrize("text", ["The weather is fine.", "[1] A citation.", "[Note (see below)] text",
                                  "Let me check: [get_time()]", "[get_time"])
def test_what_does_not_open_with_a_call_is_content(text):
    assert checks.read("pythonic", text) == (text, [])


def test_reads_what_the_llama4_template_writes(tokenizer):
    """Llama 4's template writes every argument quoted (name="value"): string arguments come back as sent."""
    calls = checks.calls_of("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time()]')
    written = checks.template_output(tokenizer, "llama4_pythonic.jinja", [ASK, checks.assistant_turn(calls)], [WEATHER, TIME],
                              "<|eot|>")
    assert written == '[get_weather(city="Paris", unit="celsius"), get_time()]'
    assert checks.read("pythonic", written, tokens=checks.token_pieces(tokenizer, written)) == \
        (None, [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})])
