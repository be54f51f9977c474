"""Where a JSON object or array that a format writes inline ends, read in pieces: the formats that follow
a marker with one JSON value (Mistral's arguments and call list, Phi-4-mini's call list) stop there."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class JsonSpan:
    """Feed it the value's text from its opening bracket on; `end` says where the value closes."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def end(self, text: str) -> int:
        """The index in text just past the bracket that closes the value, or -1 while it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return -1
