"""The request of OpenAI's Responses API (POST /v1/responses), and the input items it is read from.

The input items stay plain JSON objects here (OpenAI adds item types often); `responses_input.py`
reads the ones stepahead serves (messages, function calls and their outputs) and refuses the others
by name.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictInt

from stepahead.entrypoints.openai.protocol import OpenAIRequest

_MAX_COUNT = 2**31 - 1


class TextFormat(OpenAIRequest):
    """`text.format`: plain text, any JSON object, or a JSON schema (the structured-outputs grammar)."""

    type: str = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIRequest):
    format: TextFormat | None = None
    verbosity: str | None = None  # only "medium" (what any model does unasked) is served


class ReasoningConfig(OpenAIRequest):
    """`reasoning`: effort reaches the chat template as `reasoning_effort` (as vLLM passes it); summaries
    of the reasoning are not made, so asking for one is a 400."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # summary's older name


class ResponsesRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None  # a system message before the input; not carried to the next response
    max_output_tokens: StrictInt | None = Field(default=None, ge=1, le=_MAX_COUNT)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=2**31 - 1)
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    tools: list[dict[str, Any]] | None = None  # function tools, in the Responses form (name at the top level)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    store: bool = True  # keep the response (bounded, in memory) for previous_response_id and GET
    stream: bool = False
    background: bool = False  # not implemented: declared so that asking for it is a 400, never ignored
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    truncation: str | None = "disabled"  # "auto" (dropping input items to fit) is refused
    include: list[str] | None = None  # only "message.output_text.logprobs"
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)  # OpenAI's range
    # Declared so that each is honoured or refused by name (responses_input.check_served): hints echoed
    # back (prompt_cache_key, safety_identifier, service_tier "auto"/"default"), or features not served.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    max_tool_calls: StrictInt | None = None
    stream_options: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    priority: StrictInt = Field(default=0, ge=-(2**31), le=2**31 - 1)  # vLLM's, as on chat completions
