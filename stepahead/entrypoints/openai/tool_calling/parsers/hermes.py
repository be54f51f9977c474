"""Hermes (Qwen, NousResearch): calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Text before the first call is content; text after a call and between calls is dropped (vLLM's rule). The
markers are read as text: Qwen's tokenizers hold them as tokens, other models (SmolLM2) spell them out."""

from __future__ import annotations

from stepahead.entrypoints.openai.tool_calling.call_stream import CallScanner
from stepahead.entrypoints.openai.tool_calling.parsers.base import StreamDelta, ToolStream, held_prefix

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolStream(ToolStream):
    MARKERS = (OPEN, CLOSE)  # special tokens in some models' tokenizers

    def __init__(self) -> None:
        self._scanner = CallScanner(base=0)
        self._buffer = ""
        self._in_call = False
        self._seen_call = False

    def feed(self, text: str) -> StreamDelta:
        self._buffer += text
        out = StreamDelta()
        while True:
            marker = CLOSE if self._in_call else OPEN
            index = self._buffer.find(marker)
            if index < 0:
                keep = held_prefix(self._buffer, marker)
                self._take(self._buffer[:len(self._buffer) - keep], out)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return out
            self._take(self._buffer[:index], out)
            self._buffer = self._buffer[index + len(marker):]
            self._in_call = not self._in_call
            if not self._seen_call:
                self._unclaimed = marker
            elif self._unclaimed is not None:
                self._unclaimed += marker
            self._seen_call = True

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        self._take(self._buffer, out)
        self._buffer = ""
        out.content += self._unclaimed_content()
        return out

    def _take(self, text: str, out: StreamDelta) -> None:
        if self._in_call:
            out.tool_calls += self._claim(text, self._scanner.feed(text))
        elif not self._seen_call:
            out.content += text
        elif self._unclaimed is not None:
            self._unclaimed += text
