"""The interface of a reasoning parser: a per-choice stream that splits the output into reasoning (vLLM's
`reasoning_content`) and content as it is generated. The non-streaming response runs the same stream over
the whole output, so both ways split alike."""

from __future__ import annotations

from dataclasses import dataclass

from stepahead.entrypoints.openai.tool_calling.parsers.base import held_prefix


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """Reasoning until the `end` marker, content after it. An output opening with the `start` marker
    (dropped) is reasoning; otherwise `in_reasoning` says how it begins. Text that could begin a marker
    waits for the next piece. may_open False: the prompt closed the reasoning, the output is all content."""

    def __init__(self, start: str, end: str, in_reasoning: bool, may_open: bool = True) -> None:
        self._start, self._end = start, end
        self._in_reasoning = in_reasoning  # how the output begins when it does not open with `start`
        self._decided = not may_open  # False: the output's start is still being read
        self._buffer = ""

    def feed(self, text: str) -> ReasoningDelta:
        self._buffer += text
        out = ReasoningDelta()
        if not self._decided:
            start = self._buffer.lstrip()
            if self._start.startswith(start) and len(start) < len(self._start):
                return out  # whitespace or part of the marker so far
            self._decided = True
            if start.startswith(self._start):
                self._in_reasoning, self._buffer = True, start[len(self._start):]
        if not self._in_reasoning:
            out.content, self._buffer = self._buffer, ""
            return out
        index = self._buffer.find(self._end)
        if index >= 0:
            out.reasoning = self._buffer[:index]
            out.content = self._buffer[index + len(self._end):]
            self._in_reasoning, self._buffer = False, ""
            return out
        keep = held_prefix(self._buffer, self._end)
        out.reasoning, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
        return out

    def finish(self) -> ReasoningDelta:
        text, self._buffer = self._buffer, ""
        if self._in_reasoning:
            return ReasoningDelta(reasoning=text)
        return ReasoningDelta(content=text)


def split(stream: ReasoningStream, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    out = stream.feed(text)
    rest = stream.finish()
    reasoning = out.reasoning + rest.reasoning
    return (reasoning or None), out.content + rest.content
