"""--tool-call-parser phi4_mini_json on what Phi-4-mini writes (`functools[...]`, as its tool prompt asks),
streamed in every split and whole. Its templates write no calls back in this form (vLLM's example renders
them as bare JSON objects), so there is no template to read back here."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.tool_parser_checks import family_tokenizer, read, token_pieces

OUTPUT = ('functools[{"name": "get_weather", "arguments": {"city": "Pa\\"ris [x]"}}, '
          '{"name": "get_time", "arguments": {}}]')
EXPECTED = [("get_weather", {"city": 'Pa"ris [x]'}), ("get_time", {})]


def test_the_call_list(tokenizer_folder):
    tokenizer = family_tokenizer(tokenizer_folder)
    assert read("phi4_mini_json", OUTPUT, tokens=token_pieces(tokenizer, OUTPUT)) == (None, EXPECTED)
    assert read("phi4_mini_json", "Checking. functools [" + OUTPUT[len("functools["):] + " done") == \
        ("Checking. ", EXPECTED)


@pytest.mark.parametrize("text", ["The functools module helps.", "import functools\nfunctools.reduce",
                                  "functools", "functools[]", "no call functool"])
def test_what_holds_no_call_is_content(text):
    assert read("phi4_mini_json", text) == (text, [])
