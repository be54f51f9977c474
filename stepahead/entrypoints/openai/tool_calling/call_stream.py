"""An incremental scan of JSON tool calls as they are generated, for streaming `delta.tool_calls`.

The calls come as objects {"name": "...", "arguments"|"parameters": {...}}, alone, in an array, or one
after another: `CallScanner.feed` takes the next piece of text and returns the call deltas it completes,
OpenAI's way: a call's id, type and name first (once its name string has closed), then fragments of its
arguments, the raw JSON text of that value. Arguments that come before the name wait for it. One pass
over each character; no re-parsing of what came before.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from stepahead.entrypoints.openai.tool_calling.json_span import JsonSpan

ARGUMENT_KEYS = ("arguments", "parameters")


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other id on the next turn."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def header_delta(index: int, call_id: str, name: str, arguments: str = "") -> dict:
    """A call's first delta: its id, type and name (OpenAI sends them once, before the arguments)."""
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def append_arguments(deltas: list[dict], index: int, text: str) -> None:
    """More of a call's arguments, merged into the last delta when that is the same call's."""
    if deltas and deltas[-1]["index"] == index:
        deltas[-1]["function"]["arguments"] += text
    else:
        deltas.append({"index": index, "function": {"arguments": text}})


@dataclass
class _Call:
    index: int
    id: str
    name: str | None = None
    announced: bool = False
    waiting: str = ""  # argument text seen before the name


@dataclass
class CallScanner:
    """Feed it the text of the calls; `base` is the depth at which call objects open (0 alone, 1 in an array)."""

    base: int = 0
    new_id: Callable[[], str] = tool_call_id  # the format's kind of call id
    calls: list[_Call] = field(default_factory=list)
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _string: list[str] = field(default_factory=list)  # a key or the name, while it is read
    _reading: str | None = None  # "key" or "name": what the current string at call depth is
    _key: str | None = None  # the last key read at call depth
    _expect_key: bool = False
    _args: JsonSpan | None = None  # inside a call's arguments: where they end

    def feed(self, text: str) -> list[dict]:
        deltas: list[dict] = []
        i = 0
        while i < len(text):
            if self._args is not None:  # the arguments' raw text goes out as it is, up to their end
                end = self._args.end(text[i:])
                self._emit_args(text[i:] if end < 0 else text[i:i + end], deltas)
                if end < 0:
                    break
                self._args, i = None, i + end
                continue
            self._scan(text[i], deltas)
            i += 1
        return deltas

    # -- outside the arguments ----------------------------------------------------------------------------

    def _scan(self, ch: str, deltas: list[dict]) -> None:
        call_depth = self.base + 1
        if self._in_string:
            if self._string_ends(ch):
                self._close_string(deltas)
                return
            self._string.append(ch)
            return
        if ch == '"':
            self._in_string = True
            self._string = ['"']
            if self._depth == call_depth:
                self._reading = "key" if self._expect_key else ("name" if self._key == "name" else None)
            return
        if ch in "{[":
            if self._depth == call_depth and not self._expect_key and self._key in ARGUMENT_KEYS:
                self._start_args(ch, deltas)
                return
            self._depth += 1
            if ch == "{" and self._depth == call_depth:
                self.calls.append(_Call(len(self.calls), self.new_id()))
                self._expect_key, self._key = True, None
        elif ch in "}]":
            self._depth -= 1
        elif self._depth == call_depth:
            if ch == ",":
                self._expect_key = True
            elif ch == ":":
                self._expect_key = False

    def _string_ends(self, ch: str) -> bool:
        """Step over one character inside a JSON string; True on the quote that closes it."""
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._in_string = False
            return True
        return False

    def _close_string(self, deltas: list[dict]) -> None:
        reading, self._reading = self._reading, None
        if reading is None:
            if self._depth == self.base + 1 and self._key in ARGUMENT_KEYS:  # arguments given as a JSON string
                self._emit_args(json.loads("".join(self._string) + '"'), deltas)
            return
        value = json.loads("".join(self._string) + '"')
        if reading == "key":
            self._key = value
        elif reading == "name" and self.calls:
            call = self.calls[-1]
            call.name = value
            call.announced = True
            deltas.append(header_delta(call.index, call.id, value))
            if call.waiting:
                append_arguments(deltas, call.index, call.waiting)
                call.waiting = ""

    # -- inside the arguments -----------------------------------------------------------------------------

    def _start_args(self, ch: str, deltas: list[dict]) -> None:
        self._args, self._key = JsonSpan(), None
        self._args.end(ch)
        self._emit_args(ch, deltas)

    def _emit_args(self, text: str, deltas: list[dict]) -> None:
        if not self.calls or not text:
            return
        call = self.calls[-1]
        if not call.announced:
            call.waiting += text
            return
        append_arguments(deltas, call.index, text)
