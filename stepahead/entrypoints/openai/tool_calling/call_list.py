"""A JSON list of call objects written after a marker (Mistral before v11: `[TOOL_CALLS][{...}, ...]`,
Phi-4-mini: `functools[{...}, ...]`): its calls as they stream, and where the list ends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from stepahead.entrypoints.openai.tool_calling.call_stream import CallScanner, tool_call_id
from stepahead.entrypoints.openai.tool_calling.json_span import JsonSpan


@dataclass
class CallList:
    """Feed it the text from the list's `[` on."""

    new_id: Callable[[], str] = tool_call_id
    _scanner: CallScanner = field(init=False)
    _span: JsonSpan = field(default_factory=JsonSpan)

    def __post_init__(self) -> None:
        self._scanner = CallScanner(base=1, new_id=self.new_id)

    def feed(self, text: str) -> tuple[list[dict], int]:
        """The call deltas this piece completes, and the index in it just past the list's `]` (-1 while the
        list goes on; what follows that index is not the list's)."""
        end = self._span.end(text)
        used = len(text) if end < 0 else end
        return self._scanner.feed(text[:used]), (-1 if end < 0 else end)
