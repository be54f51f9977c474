"""Tool-call parsers for tool_choice "auto", by --tool-call-parser name (vLLM's names). Adding one: a
ToolStream subclass in its own file, and its name here."""

from __future__ import annotations

from stepahead.entrypoints.openai.tool_calling.parsers.base import ToolStream
from stepahead.entrypoints.openai.tool_calling.parsers.hermes import HermesToolStream
from stepahead.entrypoints.openai.tool_calling.parsers.llama3_json import Llama3JsonToolStream
from stepahead.entrypoints.openai.tool_calling.parsers.mistral import MistralToolStream
from stepahead.entrypoints.openai.tool_calling.parsers.phi4_mini_json import Phi4MiniJsonToolStream
from stepahead.entrypoints.openai.tool_calling.parsers.pythonic import PythonicToolStream
from stepahead.entrypoints.openai.tool_calling.parsers.qwen3_coder import Qwen3CoderToolStream

TOOL_PARSERS: dict[str, type[ToolStream]] = {
    "hermes": HermesToolStream,
    "llama3_json": Llama3JsonToolStream,
    "mistral": MistralToolStream,
    "phi4_mini_json": Phi4MiniJsonToolStream,
    "pythonic": PythonicToolStream,
    "qwen3_coder": Qwen3CoderToolStream,
    "qwen3_xml": Qwen3CoderToolStream,  # vLLM's qwen3_xml reads the same format
}
