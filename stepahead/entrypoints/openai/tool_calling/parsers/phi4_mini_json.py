"""Phi-4-mini: `functools` then a JSON list of calls, `functools[{"name": ..., "arguments": {...}}, ...]`
(its tool prompt asks for the marker and the list, with no closing marker). Text before the marker is
content; text after the list is dropped. "functools" not followed by `[` is just a word."""

from __future__ import annotations

from stepahead.entrypoints.openai.tool_calling.call_list import CallList
from stepahead.entrypoints.openai.tool_calling.parsers.base import StreamDelta, ToolStream, held_prefix

MARKER = "functools"


class Phi4MiniJsonToolStream(ToolStream):
    def __init__(self) -> None:
        self._buffer = ""
        self._list: CallList | None = None  # once the list has begun
        self._done = False  # the list has ended

    def feed(self, text: str) -> StreamDelta:
        out = StreamDelta()
        if self._done:
            self._claim(text, [])
            return out
        if self._list is None:
            self._buffer += text
            text = self._opening(out)
            if self._list is None:
                return out
        deltas, end = self._list.feed(text)
        out.tool_calls += self._claim(text, deltas)
        self._done = end >= 0
        return out

    def finish(self) -> StreamDelta:
        out = StreamDelta(content=self._buffer)
        self._buffer = ""
        out.content += self._unclaimed_content()
        return out

    def _opening(self, out: StreamDelta) -> str:
        """Content up to the marker that opens the list; the list's text so far once it has."""
        while True:
            index = self._buffer.find(MARKER)
            if index < 0:
                keep = held_prefix(self._buffer, MARKER)
                out.content += self._buffer[:len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return ""
            after = self._buffer[index + len(MARKER):]
            start = after.lstrip()
            if not start:
                out.content += self._buffer[:index]
                self._buffer = self._buffer[index:]
                return ""  # the marker, and perhaps whitespace: what follows decides
            if start[0] != "[":
                out.content += self._buffer[:index + len(MARKER)]
                self._buffer = after
                continue
            out.content += self._buffer[:index]
            self._unclaimed = self._buffer[index:len(self._buffer) - len(start)]
            self._buffer, self._list = "", CallList()
            return start
