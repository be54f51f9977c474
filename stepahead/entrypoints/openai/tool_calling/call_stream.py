"""An incremental scan of JSON tool calls as they are generated, for streaming `delta.tool_calls`.

The calls come as objects {"name": "...", "arguments"|"parameters": {...}}, alone, in an array, or one
after another: `CallScanner.feed` takes the next piece of text and returns the call deltas it completes,
OpenAI's way: a call's id, type and name first (once its name string has closed), then fragments of its
arguments, the raw JSON text of that value. Arguments that come before the name wait for it. One pass
over each character; no re-parsing of what came before.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

ARGUMENT_KEYS = ("arguments", "parameters")


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class _Call:
    index: int
    id: str = field(default_factory=tool_call_id)
    name: str | None = None
    announced: bool = False
    waiting: str = ""  # argument text seen before the name


@dataclass
class CallScanner:
    """Feed it the text of the calls; `base` is the depth at which call objects open (0 alone, 1 in an array)."""

    base: int = 0
    calls: list[_Call] = field(default_factory=list)
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _string: list[str] = field(default_factory=list)  # a key or the name, while it is read
    _reading: str | None = None  # "key" or "name": what the current string at call depth is
    _key: str | None = None  # the last key read at call depth
    _expect_key: bool = False
    _in_args: bool = False
    _args_depth: int = 0

    def feed(self, text: str) -> list[dict]:
        deltas: list[dict] = []
        args: list[str] = []
        for ch in text:
            if self._in_args:
                args.append(ch)
                self._scan_args(ch)
                if not self._in_args:
                    self._emit_args("".join(args), deltas)
                    args = []
                continue
            self._scan(ch, deltas)
            if self._in_args:
                args.append(ch)
        if args:
            self._emit_args("".join(args), deltas)
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
                self._start_args(ch)
                return
            self._depth += 1
            if ch == "{" and self._depth == call_depth:
                self.calls.append(_Call(len(self.calls)))
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
            deltas.append({"index": call.index, "id": call.id, "type": "function",
                           "function": {"name": value, "arguments": ""}})
            if call.waiting:
                self._append_args(call, call.waiting, deltas)
                call.waiting = ""

    # -- inside the arguments -----------------------------------------------------------------------------

    def _start_args(self, ch: str) -> None:
        self._in_args, self._args_depth, self._key = True, 1, None

    def _scan_args(self, ch: str) -> None:
        if self._in_string:
            self._string_ends(ch)
            return
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._args_depth += 1
        elif ch in "}]":
            self._args_depth -= 1
            if self._args_depth == 0:
                self._in_args = False

    def _emit_args(self, text: str, deltas: list[dict]) -> None:
        if not self.calls or not text:
            return
        call = self.calls[-1]
        if not call.announced:
            call.waiting += text
            return
        self._append_args(call, text, deltas)

    @staticmethod
    def _append_args(call: _Call, text: str, deltas: list[dict]) -> None:
        if deltas and deltas[-1]["index"] == call.index:
            deltas[-1]["function"]["arguments"] += text
        else:
            deltas.append({"index": call.index, "function": {"arguments": text}})
