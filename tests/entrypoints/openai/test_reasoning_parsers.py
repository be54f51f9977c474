"""Reasoning parsers without a server: every split of the output gives the whole output's split, for each
parser's own markers."""

from __future__ import annotations

import pytest

from stepahead.entrypoints.openai.reasoning import REASONING_PARSERS
from stepahead.entrypoints.openai.reasoning.base import split

# Outputs written with {S} and {E} for the parser's start and end markers ({s} and {e}: their first few
# characters, a marker cut short) -> (the split when the output begins in reasoning, as deepseek_r1's,
# the split when only an opening start marker begins it, as qwen3's).
CASES = {
    "{S}I think.{E}Hello!": (("I think.", "Hello!"), ("I think.", "Hello!")),
    "I think.{E}Hello!": (("I think.", "Hello!"), (None, "I think.{E}Hello!")),
    "Hello!": (("Hello!", ""), (None, "Hello!")),
    "  {S}still thinking": (("still thinking", ""), ("still thinking", "")),
    "{s}": (("{s}", ""), (None, "{s}")),
    "a {e}": (("a {e}", ""), (None, "a {e}")),
    "": ((None, ""), (None, "")),
}
# Magistral writes its markers as [THINK] and [/THINK]; Seed-OSS as <seed:think> and </seed:think>.
BEGINS_IN_REASONING = {"deepseek_r1": True, "qwen3": False, "mistral": False, "seed_oss": True}


def _spelled(text: str | None, start: str, end: str) -> str | None:
    if text is None:
        return None
    return text.format(S=start, E=end, s=start[:3], e=end[:5])


@pytest.mark.parametrize("parser", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("case", list(CASES))
def test_streamed_split_equals_the_whole(parser, case):
    assert set(BEGINS_IN_REASONING) == set(REASONING_PARSERS)
    markers = REASONING_PARSERS[parser]
    assert markers.in_reasoning == BEGINS_IN_REASONING[parser]
    text = _spelled(case, markers.start, markers.end)
    reasoning, content = CASES[case][0 if markers.in_reasoning else 1]
    expected = (_spelled(reasoning, markers.start, markers.end), _spelled(content, markers.start, markers.end))
    assert split(markers(), text) == expected
    for size in (1, 2, 5):
        stream, reasoning, content = markers(), "", ""
        for i in range(0, len(text), size):
            delta = stream.feed(text[i:i + size])
            reasoning, content = reasoning + delta.reasoning, content + delta.content
        delta = stream.finish()
        assert ((reasoning + delta.reasoning) or None, content + delta.content) == expected


@pytest.mark.parametrize("parser", sorted(REASONING_PARSERS))
def test_a_prompt_that_closes_the_reasoning_leaves_content(parser):
    markers = REASONING_PARSERS[parser]
    prompt = f"<|user|>Hi<|assistant|>{markers.start}\n\n{markers.end}\n\n"
    assert markers.closes_reasoning(prompt) and not markers.closes_reasoning(prompt + "Hello")
    closed = markers(closed_in_prompt=True)
    assert split(closed, f"{markers.start}x{markers.end}y") == (None, f"{markers.start}x{markers.end}y")
