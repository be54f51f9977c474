"""Llama 3.x JSON tool calls: the output is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`, several separated by `;`); an output that does not start with `{` is content."""

from __future__ import annotations

from stepahead.entrypoints.openai.tool_calling.call_stream import CallScanner
from stepahead.entrypoints.openai.tool_calling.parsers.base import StreamDelta, ToolStream

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolStream(ToolStream):
    def __init__(self) -> None:
        self._scanner = CallScanner(base=0)
        self._head = ""  # output before its kind is known
        self._calls: bool | None = None  # None: not decided yet

    def feed(self, text: str) -> StreamDelta:
        if self._calls is None:
            self._head += text
            start = self._head.lstrip()
            if start.startswith(PYTHON_TAG):
                start = start[len(PYTHON_TAG):].lstrip()
            if not start or (PYTHON_TAG.startswith(start) and len(start) < len(PYTHON_TAG)):
                return StreamDelta()  # whitespace, or the tag so far
            self._calls = start.startswith("{")
            if self._calls:
                self._unclaimed = self._head[:len(self._head) - len(start)]
            text, self._head = (start if self._calls else self._head), ""
        if self._calls:
            return StreamDelta(tool_calls=self._claim(text, self._scanner.feed(text)))
        return StreamDelta(content=text)

    def finish(self) -> StreamDelta:
        head, self._head = self._head, ""
        return StreamDelta(content=head + self._unclaimed_content())
