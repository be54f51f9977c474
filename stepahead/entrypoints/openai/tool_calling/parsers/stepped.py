"""A tool-call stream that reads its output part by part (a format of several markers: Mistral's,
Qwen3-Coder's): the output waits in a buffer, and `_step` reads what it holds of the current part."""

from __future__ import annotations

from abc import abstractmethod

from stepahead.entrypoints.openai.tool_calling.parsers.base import StreamDelta, ToolStream


class SteppedToolStream(ToolStream):
    def __init__(self) -> None:
        self._buffer = ""

    def feed(self, text: str) -> StreamDelta:
        self._buffer += text
        out = StreamDelta()
        while self._step(out):
            pass
        return out

    @abstractmethod
    def _step(self, out: StreamDelta) -> bool:
        """Read what the buffer holds of the current part; True when the next part may read on."""

    def _take(self, size: int) -> None:
        """Pass over the buffer's first `size` characters (markers, names, text between calls): they are
        content only if no call ever appears."""
        self._claim(self._buffer[:size], [])
        self._buffer = self._buffer[size:]


def first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """Where the earliest of the markers occurs in text, and which it is; None if none does."""
    found = [(index, marker) for marker in markers if (index := text.find(marker)) >= 0]
    return min(found) if found else None
