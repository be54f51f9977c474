"""Which ToolStream reads a choice's output under a plan, and the finish_reason its calls give."""

from __future__ import annotations

from stepahead.entrypoints.openai.tool_calling.constrained import NamedToolStream, RequiredToolStream
from stepahead.entrypoints.openai.tool_calling.parsers import TOOL_PARSERS
from stepahead.entrypoints.openai.tool_calling.parsers.base import ToolStream
from stepahead.entrypoints.openai.tool_calling.tools import ToolPlan


def tool_stream(plan: ToolPlan | None, parser: str | None) -> ToolStream | None:
    """None: the output is plain content (no tools, tool_choice "none")."""
    if plan is None or plan.mode == "none":
        return None
    if plan.mode == "required":
        return RequiredToolStream()
    if plan.mode == "named":
        assert plan.named is not None  # a named plan names its function
        return NamedToolStream(plan.named)
    assert parser is not None  # "auto" is refused unless the server has a tool-call parser
    return TOOL_PARSERS[parser].for_tools(plan.functions)


def finish_reason(plan: ToolPlan | None, called: bool, reason: str | None) -> str | None:
    """"tool_calls" when calls were made under "auto" or "required" and the output ended normally; a named
    function keeps "stop", as OpenAI and vLLM answer."""
    if called and reason == "stop" and plan is not None and plan.mode in ("auto", "required"):
        return "tool_calls"
    return reason
