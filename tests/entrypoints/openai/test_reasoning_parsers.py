"""Reasoning parsers without a server: every split of the output gives the whole output's split."""

from __future__ import annotations

import pytest

from stepahead.entrypoints.openai.reasoning import REASONING_PARSERS
from stepahead.entrypoints.openai.reasoning.base import split

CASES = {  # output -> (deepseek_r1's split, qwen3's split)
    "<think>I think.</think>Hello!": (("I think.", "Hello!"), ("I think.", "Hello!")),
    "I think.</think>Hello!": (("I think.", "Hello!"), (None, "I think.</think>Hello!")),
    "Hello!": (("Hello!", ""), (None, "Hello!")),
    "  <think>still thinking": (("still thinking", ""), ("still thinking", "")),
    "<th": (("<th", ""), (None, "<th")),
    "a </thi": (("a </thi", ""), (None, "a </thi")),
    "": ((None, ""), (None, "")),
}


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", list(CASES))
def test_streamed_split_equals_the_whole(parser, text):
    expected = CASES[text][0 if parser == "deepseek_r1" else 1]
    assert split(REASONING_PARSERS[parser](), text) == expected
    for size in (1, 2, 5):
        stream, reasoning, content = REASONING_PARSERS[parser](), "", ""
        for i in range(0, len(text), size):
            delta = stream.feed(text[i:i + size])
            reasoning, content = reasoning + delta.reasoning, content + delta.content
        delta = stream.finish()
        assert ((reasoning + delta.reasoning) or None, content + delta.content) == expected
