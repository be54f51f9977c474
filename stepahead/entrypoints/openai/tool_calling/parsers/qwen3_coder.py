"""Qwen3-Coder's XML calls, one block per call:

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is the text between its tags less one newline on each side, made a JSON value by the parameter's
type in the function's schema (typed_values.py). A bare `<function=...>` block without `<tool_call>`
counts too, and a call whose parameters all closed is complete even if `</function>` never came (vLLM
reads both). Text before the first call is content; text between and after calls is dropped. The
arguments stream a parameter at a time, as each value closes.

`qwen3_xml` is the same parser: vLLM's `qwen3_xml` reads this same format (with another XML reader)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from enum import Enum
from typing import Any

from stepahead.entrypoints.openai.tool_calling.call_stream import append_arguments, header_delta, tool_call_id
from stepahead.entrypoints.openai.tool_calling.parsers.base import StreamDelta, held_prefix
from stepahead.entrypoints.openai.tool_calling.parsers.stepped import SteppedToolStream, first_marker
from stepahead.entrypoints.openai.tool_calling.parsers.typed_values import typed_value
from stepahead.entrypoints.openai.tool_calling.tools import Function

OPEN_CALL, CLOSE_CALL = "<tool_call>", "</tool_call>"
OPEN_FUNCTION, CLOSE_FUNCTION = "<function=", "</function>"
OPEN_PARAMETER, CLOSE_PARAMETER = "<parameter=", "</parameter>"


class _Part(Enum):
    CONTENT = "content"  # before the first call
    OUTSIDE = "outside"  # between calls: the next <function=, other text dropped
    NAME = "name"  # the function's name, up to ">"
    BODY = "body"  # in the function: the next <parameter= or </function>
    PARAMETER = "parameter"  # the parameter's name, up to ">"
    VALUE = "value"  # the parameter's value, up to </parameter>


class Qwen3CoderToolStream(SteppedToolStream):
    MARKERS = (OPEN_CALL, CLOSE_CALL)
    REQUIRED_TOKENS = (OPEN_CALL, CLOSE_CALL)

    def __init__(self, functions: Sequence[Function] = ()) -> None:
        super().__init__()
        self._properties = {f.name: f.parameters.get("properties") or {} for f in functions}
        self._part = _Part.CONTENT
        self._calls = 0  # calls begun
        self._function: str | None = None
        self._parameter = ""
        self._written = 0  # parameters of the current call sent

    @classmethod
    def for_tools(cls, functions: Sequence[Function]) -> Qwen3CoderToolStream:
        return cls(functions)

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self._part is _Part.CONTENT:
            out.content = self._buffer
        elif self._part is _Part.BODY:
            self._close_arguments(out)  # every parameter closed: the call is whole
        self._claim(self._buffer if self._part is not _Part.CONTENT else "", [])
        self._buffer = ""
        out.content += self._unclaimed_content()
        return out

    def _step(self, out: StreamDelta) -> bool:
        if self._part in (_Part.CONTENT, _Part.OUTSIDE):
            return self._opening(out)
        if self._part in (_Part.NAME, _Part.PARAMETER):
            end = self._buffer.find(">")
            if end < 0:
                return False
            name = self._buffer[:end].strip()
            self._take(end + 1)
            if self._part is _Part.PARAMETER:
                self._parameter, self._part = name, _Part.VALUE
                return True
            self._function, self._written, self._part = name, 0, _Part.BODY
            out.tool_calls += self._claim("", [header_delta(self._calls, tool_call_id(), name)])
            self._calls += 1
            return True
        if self._part is _Part.BODY:
            return self._body(out)
        return self._value(out)

    def _opening(self, out: StreamDelta) -> bool:
        """Outside a call: the next `<tool_call>` or bare `<function=`."""
        found = first_marker(self._buffer, (OPEN_CALL, OPEN_FUNCTION))
        if found is None:
            keep = max(held_prefix(self._buffer, OPEN_CALL), held_prefix(self._buffer, OPEN_FUNCTION))
            self._pass(len(self._buffer) - keep, out)
            return False
        index, marker = found
        self._pass(index, out)
        if self._part is _Part.CONTENT:
            self._unclaimed, self._part = "", _Part.OUTSIDE
        self._take(len(marker))
        if marker == OPEN_FUNCTION:
            self._part = _Part.NAME
        return True

    def _body(self, out: StreamDelta) -> bool:
        found = first_marker(self._buffer, (OPEN_PARAMETER, CLOSE_FUNCTION))
        if found is None:
            return False
        index, marker = found
        self._take(index + len(marker))
        if marker == OPEN_PARAMETER:
            self._part = _Part.PARAMETER
        else:
            self._close_arguments(out)
        return True

    def _value(self, out: StreamDelta) -> bool:
        """A value ends at </parameter>, or at </function> where the model left the parameter open."""
        found = first_marker(self._buffer, (CLOSE_PARAMETER, CLOSE_FUNCTION))
        if found is None:
            return False
        index, marker = found
        text = self._buffer[:index]
        text = text[1:] if text.startswith("\n") else text
        text = text[:-1] if text.endswith("\n") else text
        self._take(index + len(CLOSE_PARAMETER) if marker == CLOSE_PARAMETER else index)
        value = typed_value(text, self._schema(self._parameter))
        opening = "{" if self._written == 0 else ", "
        append_arguments(out.tool_calls, self._calls - 1, f"{opening}{json.dumps(self._parameter)}: "
                                                            f"{json.dumps(value, ensure_ascii=False)}")
        self._written += 1
        self._part = _Part.BODY
        return True

    def _schema(self, parameter: str) -> dict[str, Any] | None:
        schema = self._properties.get(self._function or "", {}).get(parameter)
        return schema if isinstance(schema, dict) else None

    def _close_arguments(self, out: StreamDelta) -> None:
        append_arguments(out.tool_calls, self._calls - 1, "}" if self._written else "{}")
        self._part = _Part.OUTSIDE

    def _pass(self, size: int, out: StreamDelta) -> None:
        """Text outside calls: content before the first, dropped after it."""
        if self._part is _Part.CONTENT:
            out.content += self._buffer[:size]
            self._buffer = self._buffer[size:]
        else:
            self._take(size)
