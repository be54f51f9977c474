"""The interface of a tool-call parser: a per-choice stream that splits the output into content and
OpenAI `delta.tool_calls` entries as it is generated. The non-streaming response runs the same stream
over the whole output (`collect`), so both ways give the same calls."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from stepahead.entrypoints.openai.tool_calling.tools import Function


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __iadd__(self, other: StreamDelta) -> StreamDelta:
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class ToolStream(ABC):
    """One choice's output, fed in pieces. Subclasses: one per output format (a file each)."""

    # The markers the stream reads in the output text: where the tokenizer makes one a special token, the
    # requests it reads decode with special tokens kept (else the detokenizer would drop the marker).
    MARKERS: ClassVar[tuple[str, ...]] = ()
    # Markers a model of the family writes as single tokens of its own (vLLM's check): the server refuses to
    # start when the tokenizer cannot encode one as one token. Formats other models spell out as text
    # (hermes's <tool_call>) require none.
    REQUIRED_TOKENS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def for_tools(cls, functions: Sequence[Function]) -> ToolStream:
        """The stream for one choice of a request with these functions; formats that read values by the
        functions' parameter schemas override it."""
        return cls()

    _unclaimed: str | None = None  # output since calls seemed to begin, until one does: content if none does

    def _claim(self, text: str, deltas: list[dict]) -> list[dict]:
        """Hold text that should hold calls until a call appears; `deltas`: the calls it gave."""
        if self._unclaimed is not None:
            self._unclaimed = None if deltas else self._unclaimed + text
        return deltas

    def _unclaimed_content(self) -> str:
        """At the end: the held text when no call ever appeared (it is content after all)."""
        text, self._unclaimed = self._unclaimed or "", None
        return text

    @abstractmethod
    def feed(self, text: str) -> StreamDelta:
        """The content and call deltas this piece of output completes (text may be held back)."""

    def finish(self) -> StreamDelta:
        """Whatever was held back, once the output has ended."""
        return StreamDelta()


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of text that could begin marker (it must wait for the next piece)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def collect(stream: ToolStream, text: str) -> tuple[str | None, list[ToolCall]]:
    """The content and the calls of a whole output. A call whose name is missing or whose arguments are
    not JSON makes the whole output content, no calls (vLLM's rule: never a call the client cannot parse)."""
    delta = stream.feed(text)
    delta += stream.finish()
    calls: dict[int, ToolCall] = {}
    for entry in delta.tool_calls:
        function = entry["function"]
        if "id" in entry:
            calls[entry["index"]] = ToolCall(entry["id"], function["name"], function.get("arguments", ""))
        elif entry["index"] in calls:
            calls[entry["index"]].arguments += function["arguments"]
    try:
        for call in calls.values():
            json.loads(call.arguments)  # no arguments at all (an output cut short) is not JSON either
    except json.JSONDecodeError:
        return text, []
    if not calls:
        return (text if text.strip() else None), []
    content = delta.content if delta.content.strip() else None
    return content, list(calls.values())
