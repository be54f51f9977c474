"""A Responses API request as the chat completion it runs as, and the stored conversations behind
previous_response_id.

Input items: a string (one user message); messages ({"role", "content"}: a string or input_text /
output_text parts; "developer" is a system message); "function_call" items (an assistant's earlier
call) and "function_call_output" items (its result, a role "tool" message). Function tools move from
the Responses form ({"type": "function", "name", "parameters"}) to the chat form. Anything else is a
400 naming the item.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, cast

from stepahead.entrypoints.openai.errors import APIError
from stepahead.entrypoints.openai.protocol import (
    REASONING_EFFORTS,
    ChatCompletionRequest,
    ChatMessage,
    ReasoningEffort,
    ResponseFormat,
    StreamOptions,
    ToolCall,
    ToolCallFunction,
)
from stepahead.entrypoints.openai.responses_protocol import ResponsesRequest
from stepahead.validation import shorten

# Stored responses kept for previous_response_id (the oldest goes first): a client that never sends
# one back must not grow the server's memory.
DEFAULT_MAX_STORED_RESPONSES = 1024
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


@dataclass
class StoredResponse:
    """A response kept for later: the conversation through its output, and its JSON for GET."""

    messages: list[ChatMessage]
    body: dict[str, Any]


@dataclass
class ResponseStore:
    """The last `capacity` stored responses, by id."""

    capacity: int = DEFAULT_MAX_STORED_RESPONSES
    _items: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(f"Response with id '{shorten(response_id)}' not found.", 404, "previous_response_id")
        return stored

    def __len__(self) -> int:
        return len(self._items)


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of text parts", 400, "input")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(f"{where}.content[{k}]: only text parts are supported, got {shorten(repr(kind))}",
                           400, "input")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """The request's input as chat messages; consecutive function calls become one assistant message."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    if not items:
        raise APIError("input must not be empty", 400, "input")
    messages: list[ChatMessage] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            given = item.get("role")
            role = _ROLES.get(given) if isinstance(given, str) else None
            if role is None:
                raise APIError(f"{where}.role must be one of {sorted(_ROLES)}, got {shorten(repr(item.get('role')))}",
                               400, "input")
            messages.append(ChatMessage(role=role, content=_text_of(item.get("content"), where)))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls and not last.content:
                last.tool_calls.append(call)
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise APIError(f"{where}: a function_call_output needs call_id and output strings", 400, "input")
            messages.append(ChatMessage(role="tool", tool_call_id=call_id, content=output))
        else:
            raise APIError(f"{where}: input items of type {shorten(repr(kind))} are not supported (message, "
                           "function_call and function_call_output are)", 400, "input")
    return messages


def _function_call(item: dict[str, Any], where: str) -> ToolCall:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
        raise APIError(f"{where}: a function_call needs call_id, name and arguments strings", 400, "input")
    return ToolCall(id=call_id, function=ToolCallFunction(name=name, arguments=arguments))


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in the chat form; other tool types are a 400 naming them."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(f"tools[{i}]: only function tools are supported, got type "
                           f"{shorten(repr(tool.get('type')))}", 400, "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.type == "json_schema":
        return ResponseFormat(type="json_schema", json_schema={"name": fmt.name, "schema": fmt.schema_,
                                                               "strict": fmt.strict})
    raise APIError(f"text.format.type must be text, json_object or json_schema, got {shorten(repr(fmt.type))}",
                   400, "text")


OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one `include` value served
SERVICE_TIERS = ("auto", "default")


def _refuse(field: str, why: str) -> APIError:
    return APIError(f"{field}: {why}", 400, field.split(".")[0].split("[")[0])


def check_served(req: ResponsesRequest) -> None:
    """Every field is honoured or refused here by name: nothing is accepted and ignored."""
    extra = sorted({*(req.model_extra or {}),
                    *(f"text.{k}" for k in ((req.text.model_extra if req.text else None) or {})),
                    *(f"reasoning.{k}" for k in ((req.reasoning.model_extra if req.reasoning else None) or {}))})
    if extra:
        raise APIError(f"unsupported fields: {shorten(repr(extra))} (this server refuses fields it does not serve)",
                       400, extra[0].split(".")[0])
    reasoning = req.reasoning
    if reasoning is not None:
        if reasoning.effort is not None and reasoning.effort not in REASONING_EFFORTS:
            raise _refuse("reasoning.effort", f"must be one of {list(REASONING_EFFORTS)}, got "
                                              f"{shorten(repr(reasoning.effort))}")
        for name in ("summary", "generate_summary"):
            if getattr(reasoning, name) is not None:
                raise _refuse(f"reasoning.{name}", "reasoning summaries are not made by this server")
    if req.truncation not in (None, "disabled"):
        raise _refuse("truncation", f"only 'disabled' is served (a prompt too long is a 400), got "
                                    f"{shorten(repr(req.truncation))}")
    for i, value in enumerate(req.include or ()):
        if value != OUTPUT_LOGPROBS:
            raise _refuse(f"include[{i}]", f"only {OUTPUT_LOGPROBS!r} is served, got {shorten(repr(value))}")
    if req.service_tier not in (None, *SERVICE_TIERS):
        raise _refuse("service_tier", f"must be one of {list(SERVICE_TIERS)}, got {shorten(repr(req.service_tier))}")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise _refuse("text.verbosity", f"only 'medium' is served, got {shorten(repr(req.text.verbosity))}")
    if req.stream_options and any(v for v in req.stream_options.values()):
        raise _refuse("stream_options", f"no stream option is served (events are not obfuscated), got "
                                        f"{shorten(repr(req.stream_options))}")
    for name in ("max_tool_calls", "conversation", "prompt"):
        if getattr(req, name) is not None:
            raise _refuse(name, "not served by this server")


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Output text logprobs: asked for with include, or by top_logprobs (their count)."""
    return OUTPUT_LOGPROBS in (req.include or ()) or req.top_logprobs is not None


def chat_request(req: ResponsesRequest, history: list[ChatMessage]) -> tuple[ChatCompletionRequest, list[ChatMessage]]:
    """The chat completion the request runs as, and the conversation to store with its output
    (history and input, without the instructions, which do not carry over)."""
    conversation = [*history, *input_messages(req.input)]
    messages = conversation
    if req.instructions:
        messages = [ChatMessage(role="system", content=req.instructions), *conversation]
    stream_options = StreamOptions(include_usage=True) if req.stream else None
    effort = cast(ReasoningEffort | None, req.reasoning.effort if req.reasoning is not None else None)  # checked
    logprobs = wants_logprobs(req)
    chat = ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
        tools=chat_tools(req.tools), tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, stream=req.stream, stream_options=stream_options,
        response_format=_response_format(req), user=req.user,
        reasoning_effort=effort,
        logprobs=logprobs, top_logprobs=(req.top_logprobs or 0) if logprobs else None, priority=req.priority)
    return chat, conversation
