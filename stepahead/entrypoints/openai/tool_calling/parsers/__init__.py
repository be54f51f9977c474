"""Tool-call parsers for tool_choice "auto", by --tool-call-parser name. Adding one: a ToolStream
subclass in its own file, and its name here."""

from __future__ import annotations

from stepahead.entrypoints.openai.tool_calling.parsers.base import ToolStream
from stepahead.entrypoints.openai.tool_calling.parsers.hermes import HermesToolStream
from stepahead.entrypoints.openai.tool_calling.parsers.llama3_json import Llama3JsonToolStream

TOOL_PARSERS: dict[str, type[ToolStream]] = {
    "hermes": HermesToolStream,
    "llama3_json": Llama3JsonToolStream,
}
