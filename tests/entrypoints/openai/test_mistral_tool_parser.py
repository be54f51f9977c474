"""--tool-call-parser mistral on what Mistral models write (both tokenizer generations' forms), streamed in
every split and whole, and on what Mistral's chat templates write back when the calls return next turn."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai import tool_parser_checks as checks

MARKERS = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = {"role": "user", "content": "Weather in Paris, and the time?"}
EXPECTED = [("get_weather", {"city": "Pa\"ris [x]", "days": 3}), ("get_time", {})]

OUTPUTS = {
    # Before v11 one list; some templates put a space after the marker, ids are the model's own or absent.
    "list": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa\\"ris [x]", "days": 3}, '
            '"id": "a1b2c3d4e"}, {"name": "get_time", "arguments": {}, "id": "f5g6h7i8j"}]',
    "spaced list": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Pa\\"ris [x]", "days": 3}}, '
                   '{"name": "get_time", "arguments": {}}]',
    # v11 on: a marker per call; [CALL_ID] in v7-era templates; a decoder that drops [ARGS] leaves name{...}.
    "v11": '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa\\"ris [x]", "days": 3}[TOOL_CALLS]get_time[ARGS]{}',
    "call ids": '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Pa\\"ris [x]", "days": 3}'
                '[TOOL_CALLS]get_time[CALL_ID]f5g6h7i8j[ARGS]{}',
    "no [ARGS]": '[TOOL_CALLS]get_weather{"city": "Pa\\"ris [x]", "days": 3}[TOOL_CALLS]get_time{}',
}


@pytest.fixture(scope="module")
def tokenizer(tokenizer_folder):
    return checks.family_tokenizer(tokenizer_folder, special=MARKERS)


@pytest.mark.parametrize("form", list(OUTPUTS))
def test_both_generations_forms(tokenizer, form):
    text = OUTPUTS[form]
    assert checks.read("mistral", text, tokens=checks.token_pieces(tokenizer, text)) == (None, EXPECTED)
    content, calls = checks.read("mistral", "Let me look. " + text)
    assert (content, calls) == ("Let me look. ", EXPECTED)


def test_ids_are_nine_letters_and_digits():
    for call in checks.calls_of("mistral", OUTPUTS["v11"]) + checks.calls_of("mistral", OUTPUTS["list"]):
        assert len(call.id) == 9 and call.id.isalnum()


@pytest.mark.parametrize("text", ["[TOOL_CALLS]", "[TOOL_CALLS] I cannot call that.", "[TOOL_CALLS][ARGS]{}",
                                  "[TOOL_CALLS][]", "No call, just [TOOL_CALL"])
def test_what_holds_no_call_is_content(text):
    assert checks.read("mistral", text) == (text, [])


def test_a_call_cut_short_makes_the_whole_output_content():
    """Streamed, its name has gone out; whole, the output is content (no call the client cannot parse)."""
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa'
    assert checks.calls_of("mistral", text) == []


@pytest.mark.parametrize("template, end", [("mistral_v3.jinja", "<|im_end|>"), ("mistral_v13.jinja", "</s>")])
def test_reads_what_the_templates_write(tokenizer, template, end):
    """The calls go back through the template as the client sends them (with the parser's ids: the v3
    template refuses any id but nine characters) and the template's writing of them reads the same."""
    calls = checks.calls_of("mistral", OUTPUTS["v11"])
    written = checks.template_output(tokenizer, template, [ASK, checks.assistant_turn(calls)], [WEATHER, TIME], end)
    assert written.startswith("[TOOL_CALLS]")
    assert checks.read("mistral", written, tokens=checks.token_pieces(tokenizer, written)) == (None, EXPECTED)
