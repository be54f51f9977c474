"""Pythonic calls (Llama 3.2, Llama 4): the whole output is a Python list of calls with keyword arguments,
`[get_weather(city="Paris", days=3), get_time()]`. No marker opens it, so an output that does not begin
(after whitespace) with `[name(` is content, as vLLM reads it; the templates ask for the list alone.

Each call is parsed with `ast` once its `)` closes and goes out whole: its id, name and arguments, the
keyword arguments' literal values (strings, numbers, booleans, None, lists, tuples and dicts of them) as
JSON. A call that is not such (positional arguments, a variable, an expression) ends the list there: the
calls before it stand, and without any the output is content. Text after the list is dropped."""

from __future__ import annotations

import ast
import json
from typing import Any

from stepahead.entrypoints.openai.tool_calling.call_stream import header_delta, tool_call_id
from stepahead.entrypoints.openai.tool_calling.parsers.base import StreamDelta, ToolStream

_OPEN, _CLOSE = "([{", ")]}"


class PythonicToolStream(ToolStream):
    def __init__(self) -> None:
        self._head = ""  # the output while its kind is unknown
        self._calls: bool | None = None  # None: not decided yet
        self._done = False  # the list ended (or stopped at a call it could not read)
        self._call: list[str] = []  # the current call's text
        self._depth = 0  # brackets open in the current call
        self._quote: str | None = None  # the quote of the string the current call is in
        self._escaped = False
        self._count = 0  # calls sent

    def feed(self, text: str) -> StreamDelta:
        if self._calls is None:
            self._head += text
            self._calls = _opens_calls(self._head)
            if self._calls is None:
                return StreamDelta()
            text, self._head = self._head, ""
            if not self._calls:
                return StreamDelta(content=text)
            start = len(text) - len(text.lstrip()) + 1  # past the list's "["
            self._unclaimed, text = text[:start], text[start:]
        if not self._calls:
            return StreamDelta(content=text)
        out = StreamDelta()
        for i, ch in enumerate(text):
            if self._done:
                self._claim(text[i:], [])
                break
            self._read(ch, out)
        return out

    def finish(self) -> StreamDelta:
        head, self._head = self._head, ""
        if self._call:
            self._claim("".join(self._call), [])
        return StreamDelta(content=head + self._unclaimed_content())

    def _read(self, ch: str, out: StreamDelta) -> None:
        """One character of the list: between calls, or in one."""
        if not self._call and self._depth == 0:
            if ch in " \t\r\n,":
                self._claim(ch, [])
                return
            if ch == "]":
                self._claim(ch, [])
                self._done = True
                return
        self._call.append(ch)
        if self._quote is not None:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == self._quote:
                self._quote = None
        elif ch in "'\"":
            self._quote = ch
        elif ch in _OPEN:
            self._depth += 1
        elif ch in _CLOSE:
            self._depth -= 1
            if self._depth == 0 and ch == ")":
                self._end_call(out)
            elif self._depth < 0:
                self._stop()
        elif self._depth == 0 and ch in ",]":
            self._stop()  # a name with no call

    def _end_call(self, out: StreamDelta) -> None:
        text = "".join(self._call)
        self._call = []
        call = _parsed_call(text)
        if call is None:
            self._claim(text, [])
            self._done = True
            return
        name, arguments = call
        out.tool_calls += self._claim(text, [header_delta(self._count, tool_call_id(), name, arguments)])
        self._count += 1

    def _stop(self) -> None:
        self._claim("".join(self._call), [])
        self._call, self._done = [], True


def _opens_calls(text: str) -> bool | None:
    """Whether the output opens with `[name(`; None while too little of it has come to tell."""
    rest = text.lstrip()
    if not rest:
        return None
    if rest[0] != "[":
        return False
    rest = rest[1:].lstrip()
    if not rest:
        return None
    if not (rest[0].isalpha() or rest[0] == "_"):
        return False
    end = 1
    while end < len(rest) and (rest[end].isalnum() or rest[end] == "_"):
        end += 1
    rest = rest[end:].lstrip()
    if not rest:
        return None
    return rest[0] == "("


def _parsed_call(text: str) -> tuple[str, str] | None:
    """A call's name and JSON arguments, or None when it is not a call with literal keyword arguments."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    try:
        return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # a set, bytes, a complex number, an infinity: no JSON for it
        return None
