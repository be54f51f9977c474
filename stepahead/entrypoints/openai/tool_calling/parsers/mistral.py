"""Mistral: calls follow the `[TOOL_CALLS]` control token, in either tokenizer generation's form, told
apart by what follows the marker:

- before v11, one JSON list: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]`;
- v11 on, one marker per call: `[TOOL_CALLS]name[ARGS]{...}`, with `[CALL_ID]id` before `[ARGS]` in some
  templates, and `name{...}` where the tokenizer dropped `[ARGS]`.

Text before the first marker is content; text after the calls is dropped (vLLM's rule). Call ids are nine
letters and digits: Mistral's templates refuse any other id when the call comes back on the next turn.
`[TOOL_CALLS]` is a special token in Mistral's tokenizers: requests this parser reads decode with special
tokens kept (entrypoints/openai/parser_tokens.py)."""

from __future__ import annotations

from enum import Enum

from stepahead.entrypoints.openai.tool_calling.call_list import CallList
from stepahead.entrypoints.openai.tool_calling.call_stream import (
    append_arguments,
    header_delta,
    mistral_call_id,
)
from stepahead.entrypoints.openai.tool_calling.json_span import JsonSpan
from stepahead.entrypoints.openai.tool_calling.parsers.base import StreamDelta, held_prefix
from stepahead.entrypoints.openai.tool_calling.parsers.stepped import SteppedToolStream, first_marker

BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class _Part(Enum):
    CONTENT = "content"  # before the first marker
    OPENING = "opening"  # just after a marker: a list or a name follows
    LIST = "list"  # the pre-v11 list
    NAME = "name"  # a v11 call's name, up to [ARGS], [CALL_ID] or its arguments' "{"
    CALL_ID = "call_id"  # the model's own id, up to [ARGS]
    ARGUMENTS = "arguments"  # a v11 call's arguments object
    AFTER = "after"  # after a call: the next marker, or nothing more


class MistralToolStream(SteppedToolStream):
    MARKERS = (BOT, ARGS, CALL_ID)
    REQUIRED_TOKENS = (BOT,)

    def __init__(self) -> None:
        super().__init__()
        self._part = _Part.CONTENT
        self._list = CallList(new_id=mistral_call_id)
        self._span = JsonSpan()
        self._name = ""
        self._calls = 0  # v11 calls begun

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self._part is _Part.CONTENT:
            out.content = self._buffer
        else:
            self._claim(self._buffer, [])
        self._buffer = ""
        out.content += self._unclaimed_content()
        return out

    def _step(self, out: StreamDelta) -> bool:
        if self._part is _Part.CONTENT:
            return self._content(out)
        if self._part is _Part.OPENING:
            start = self._buffer.lstrip()
            if not start:
                return False
            self._part = _Part.LIST if start.startswith("[") else _Part.NAME
            self._take(len(self._buffer) - len(start))
            return True
        if self._part is _Part.LIST:
            deltas, end = self._list.feed(self._buffer)
            out.tool_calls += self._claim(self._buffer[:end] if end >= 0 else self._buffer, deltas)
            self._buffer = self._buffer[end:] if end >= 0 else ""
            if end >= 0:
                self._part = _Part.AFTER
            return end >= 0
        if self._part in (_Part.NAME, _Part.CALL_ID):
            return self._header(out)
        if self._part is _Part.ARGUMENTS:
            end = self._span.end(self._buffer)
            piece = self._buffer if end < 0 else self._buffer[:end]
            if piece:
                append_arguments(out.tool_calls, self._calls - 1, piece)
            self._buffer = "" if end < 0 else self._buffer[end:]
            if end >= 0:
                self._part = _Part.AFTER
            return end >= 0
        return self._after()

    def _content(self, out: StreamDelta) -> bool:
        index = self._buffer.find(BOT)
        if index < 0:
            keep = held_prefix(self._buffer, BOT)
            out.content += self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        out.content += self._buffer[:index]
        self._buffer = self._buffer[index + len(BOT):]
        self._unclaimed, self._part = BOT, _Part.OPENING
        return True

    def _header(self, out: StreamDelta) -> bool:
        """The name (and a [CALL_ID]) up to the arguments: then the call's id and name go out."""
        found = first_marker(self._buffer, (ARGS, CALL_ID, "{"))
        if found is None:
            return False  # the name goes on (names are short: it waits whole)
        index, marker = found
        if self._part is _Part.NAME:
            self._name = self._buffer[:index].strip()
        self._take(index + (0 if marker == "{" else len(marker)))
        if marker == CALL_ID:
            self._part = _Part.CALL_ID
            return True
        if not self._name:
            self._part = _Part.AFTER  # no name: not a call (its text stays unclaimed)
            return True
        out.tool_calls += self._claim("", [header_delta(self._calls, mistral_call_id(), self._name)])
        self._calls += 1
        self._part, self._span = _Part.ARGUMENTS, JsonSpan()
        return True

    def _after(self) -> bool:
        index = self._buffer.find(BOT)
        if index < 0:
            self._take(len(self._buffer) - held_prefix(self._buffer, BOT))
            return False
        self._take(index + len(BOT))
        self._part = _Part.OPENING
        return True
