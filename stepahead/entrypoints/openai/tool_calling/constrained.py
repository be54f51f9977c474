"""The output of tool_choice "required" and of a named function, generated under the plan's JSON schema
(tools.py), as a ToolStream: an array of {"name", "parameters"} calls, or the named call's arguments."""

from __future__ import annotations

from stepahead.entrypoints.openai.tool_calling.call_stream import CallScanner, header_delta, tool_call_id
from stepahead.entrypoints.openai.tool_calling.parsers.base import StreamDelta, ToolStream


class RequiredToolStream(ToolStream):
    def __init__(self) -> None:
        self._scanner = CallScanner(base=1)

    def feed(self, text: str) -> StreamDelta:
        return StreamDelta(tool_calls=self._scanner.feed(text))


class NamedToolStream(ToolStream):
    """The whole output is the arguments: the call's id and name go out first, then the output as it comes."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._announced = False

    def feed(self, text: str) -> StreamDelta:
        if not self._announced:  # one entry per call in a delta: the first text goes with the name
            self._announced = True
            return StreamDelta(tool_calls=[header_delta(0, tool_call_id(), self._name, text)])
        return StreamDelta(tool_calls=[{"index": 0, "function": {"arguments": text}}] if text else [])
