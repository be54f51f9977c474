"""POST /v1/responses (and GET /v1/responses/{id}): OpenAI's Responses API over the chat path.

A request runs as the chat completion `responses_input.chat_request` makes of it (same template,
tools, grammars, reasoning split and checks); its output becomes Responses output items: a
"reasoning" item, a "message" item with one output_text part, and a "function_call" item per call.
Streaming translates the chat chunks into the Responses events as they come (response.created,
response.in_progress, output_item.added, content_part.added, output_text.delta / .done,
reasoning_text.delta / .done, function_call_arguments.delta / .done, content_part.done,
output_item.done, response.completed), each sent as `event: <type>` plus its JSON `data:`.
A stored response (store, the default) keeps its conversation for previous_response_id, in memory,
for the last `ResponseStore.capacity` responses.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from stepahead.engine.async_llm import RequestStream
from stepahead.entrypoints.openai.errors import APIError, error_from_exception
from stepahead.entrypoints.openai.protocol import (
    ChatCompletionResponse,
    ChatMessage,
    ToolCall,
    ToolCallFunction,
    random_id,
)
from stepahead.entrypoints.openai.responses_input import (
    ResponseStore,
    StoredResponse,
    chat_request,
    check_served,
)
from stepahead.entrypoints.openai.responses_protocol import ResponsesRequest
from stepahead.entrypoints.openai.serving_chat import OpenAIServingChat
from stepahead.entrypoints.openai.serving_utils import SSEResponse, with_cancellation
from stepahead.validation import InvalidInputError

# Chat fields a refusal may name, as the Responses request spells them.
_RESPONSES_PARAM = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text",
                    "structured_outputs": "text"}


@dataclass
class _Reply:
    """One response being built: its request, its id, and the output items so far."""

    req: ResponsesRequest
    response_id: str
    model_name: str
    created_at: int
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    incomplete: bool = False

    def body(self, status: str) -> dict[str, Any]:
        """The Response object, in `status` ("in_progress" while streaming, then completed or incomplete)."""
        req = self.req
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "model": self.model_name,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "metadata": req.metadata or {}, "output": self.output,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
            "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "store": req.store,
            "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
            "tools": req.tools or [], "text": {"format": {"type": "text"}} if req.text is None
            else req.text.model_dump(mode="json", by_alias=True, exclude_none=True),
            "truncation": "disabled", "user": req.user, "usage": self.usage,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "top_logprobs": req.top_logprobs, "service_tier": "default", "max_tool_calls": None,
            "prompt_cache_key": req.prompt_cache_key, "safety_identifier": req.safety_identifier,
        }

    @property
    def status(self) -> str:
        return "incomplete" if self.incomplete else "completed"


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
            "total_tokens": chat_usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": (chat_usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0)},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message_item(item_id: str, text: str, status: str, logprobs: list | None = None) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}] \
        if status == "completed" else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _assistant_message(output: list[dict[str, Any]]) -> ChatMessage | None:
    """The output as the assistant turn of the stored conversation (reasoning is not carried)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [ToolCall(id=item["call_id"], function=ToolCallFunction(name=item["name"], arguments=item["arguments"]))
             for item in output if item["type"] == "function_call"]
    if not text and not calls:
        return None
    return ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, req: ResponsesRequest, raw_request: Request) -> Response:
        check_served(req)
        if req.background:
            raise APIError("background is not supported by this server", 400, "background")
        history: list[ChatMessage] = []
        if req.previous_response_id is not None:
            history = self.store.get(req.previous_response_id).messages
        # Grows with the input (a request may hold many thousands of items): off the event loop.
        chat_req, conversation = await self.chat.offload.run(chat_request, req, history)
        try:
            ctx, stream = await self.chat.start(chat_req)
        except (APIError, InvalidInputError) as e:  # name the field the client sent
            e.param = _RESPONSES_PARAM.get(e.param or "", e.param)
            raise
        reply = _Reply(req, random_id("resp"), ctx.model_name, ctx.created)
        if req.stream:
            return SSEResponse(self._events(reply, ctx, stream, conversation))
        chat_resp = await with_cancellation(raw_request, self.chat.collect_response(ctx, stream))
        assert isinstance(chat_resp, ChatCompletionResponse)
        choice = chat_resp.choices[0]
        message = choice.message
        if message.reasoning_content:
            reply.output.append(_reasoning_item(random_id("rs"), message.reasoning_content, "completed"))
        if message.content:
            # The choice's logprobs are the whole output's; the message item's text is the content's.
            logprobs = [entry.model_dump(mode="json") for entry in choice.logprobs.content or ()] \
                if choice.logprobs is not None else None
            reply.output.append(_message_item(random_id("msg"), message.content, "completed", logprobs))
        for call in message.tool_calls:
            reply.output.append(_call_item(random_id("fc"), call.id, call.function.name, call.function.arguments,
                                           "completed"))
        reply.usage = _usage(chat_resp.usage.model_dump())
        reply.incomplete = choice.finish_reason == "length"
        body = reply.body(reply.status)
        self._keep(reply, conversation, body)
        return JSONResponse(body)

    def retrieve(self, response_id: str) -> JSONResponse:
        try:
            return JSONResponse(self.store.get(response_id).body)
        except APIError as e:
            e.param = "response_id"
            raise

    def _keep(self, reply: _Reply, conversation: list[ChatMessage], body: dict[str, Any]) -> None:
        if not reply.req.store:
            return
        assistant = _assistant_message(reply.output)
        messages = [*conversation, assistant] if assistant is not None else list(conversation)
        self.store.put(reply.response_id, StoredResponse(messages, body))

    async def _events(self, reply: _Reply, ctx, stream: RequestStream,
                      conversation: list[ChatMessage]) -> AsyncGenerator[str, None]:
        events = _EventWriter()
        yield events.send("response.created", response=reply.body("in_progress"))
        yield events.send("response.in_progress", response=reply.body("in_progress"))
        builder = _StreamedOutput(reply, events)
        try:
            async with contextlib.aclosing(self.chat.chunks(ctx, stream)) as chunks:
                async for chunk in chunks:
                    for event in builder.feed(chunk):
                        yield event
            for event in builder.close():
                yield event
        except Exception as e:  # after the 200 header an error can only be an event
            err = error_from_exception(e)
            yield events.send("error", code=str(err.status), message=err.message, param=err.param)
            yield events.send("response.failed", response={**reply.body("failed"),
                                                           "error": {"code": str(err.status), "message": err.message}})
            return
        body = reply.body(reply.status)
        self._keep(reply, conversation, body)
        yield events.send(f"response.{reply.status}", response=body)


class _EventWriter:
    """Numbers the events of one stream and writes each as `event:` + `data:`."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def send(self, event_type: str, **fields: Any) -> str:
        payload = {"type": event_type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {event_type}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class _OpenItem:
    """An output item still receiving deltas."""

    kind: str  # "message", "reasoning" or "function_call"
    item_id: str
    output_index: int
    text: str = ""
    call_id: str = ""
    name: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # a message's, with include logprobs


class _StreamedOutput:
    """Chat chunks in, Responses events out; at most one text item open at a time, calls by index."""

    def __init__(self, reply: _Reply, events: _EventWriter) -> None:
        self.reply = reply
        self.events = events
        self.text_item: _OpenItem | None = None
        self.calls: dict[int, _OpenItem] = {}
        self.open_calls: list[_OpenItem] = []

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if chunk.get("usage") is not None:
            self.reply.usage = _usage(chunk["usage"])
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                logprobs = (choice.get("logprobs") or {}).get("content") or []
                out += self._text("message", delta["content"], logprobs)
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if choice.get("finish_reason") == "length":
                self.reply.incomplete = True
        return out

    def _open(self, item: dict[str, Any]) -> str:
        self.reply.output.append(item)
        return self.events.send("response.output_item.added", output_index=len(self.reply.output) - 1, item=item)

    def _text(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        out: list[str] = []
        item = self.text_item
        if item is not None and item.kind != kind:
            out += self._close_text()
            item = None
        if item is None:
            item_id = random_id("msg" if kind == "message" else "rs")
            started = _message_item(item_id, "", "in_progress") if kind == "message" else \
                _reasoning_item(item_id, "", "in_progress")
            out.append(self._open(started))
            item = self.text_item = _OpenItem(kind, item_id, len(self.reply.output) - 1)
            if kind == "message":
                out.append(self.events.send("response.content_part.added", item_id=item_id,
                                            output_index=item.output_index, content_index=0,
                                            part={"type": "output_text", "text": "", "annotations": []}))
        item.text += text
        item.logprobs += logprobs or []
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": logprobs or []} if kind == "message" else {}
        out.append(self.events.send(event, item_id=item.item_id, output_index=item.output_index, content_index=0,
                                    delta=text, **extra))
        return out

    def _close_text(self) -> list[str]:
        item, self.text_item = self.text_item, None
        if item is None:
            return []
        common = {"item_id": item.item_id, "output_index": item.output_index, "content_index": 0}
        if item.kind == "message":
            done = _message_item(item.item_id, item.text, "completed", item.logprobs)
            out = [self.events.send("response.output_text.done", **common, text=item.text, logprobs=item.logprobs),
                   self.events.send("response.content_part.done", **common, part=done["content"][0])]
        else:
            done = _reasoning_item(item.item_id, item.text, "completed")
            out = [self.events.send("response.reasoning_text.done", **common, text=item.text)]
        self.reply.output[item.output_index] = done
        out.append(self.events.send("response.output_item.done", output_index=item.output_index, item=done))
        return out

    def _call(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        index = delta.get("index", 0)
        function = delta.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            out += self._close_text()
            item_id = random_id("fc")
            call_id, name = delta.get("id") or random_id("call"), function.get("name") or ""
            out.append(self._open(_call_item(item_id, call_id, name, "", "in_progress")))
            item = self.calls[index] = _OpenItem("function_call", item_id, len(self.reply.output) - 1,
                                                 call_id=call_id, name=name)
            self.open_calls.append(item)
        arguments = function.get("arguments")
        if arguments:
            item.text += arguments
            out.append(self.events.send("response.function_call_arguments.delta", item_id=item.item_id,
                                        output_index=item.output_index, delta=arguments))
        return out

    def close(self) -> list[str]:
        """Every item still open, done, in output order."""
        out = self._close_text()
        for item in self.open_calls:
            done = _call_item(item.item_id, item.call_id, item.name, item.text, "completed")
            self.reply.output[item.output_index] = done
            out.append(self.events.send("response.function_call_arguments.done", item_id=item.item_id,
                                        output_index=item.output_index, name=item.name, arguments=item.text))
            out.append(self.events.send("response.output_item.done", output_index=item.output_index, item=done))
        self.open_calls = []
        return out

