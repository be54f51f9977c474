"""POST /v1/chat/completions: messages through the model's chat template, n choices, streamed or not."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from stepahead.engine.async_llm import RequestStream
from stepahead.entrypoints.openai.errors import APIError
from stepahead.entrypoints.openai.parser_tokens import parser_tokens
from stepahead.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatToolCall,
    TopLogprob,
    UsageInfo,
    random_id,
)
from stepahead.entrypoints.openai.reasoning import REASONING_PARSERS
from stepahead.entrypoints.openai.reasoning.base import ReasoningDelta, ReasoningStream
from stepahead.entrypoints.openai.reasoning.base import split as split_reasoning
from stepahead.entrypoints.openai.serving_base import Choice, OpenAIServing, ResponseContext
from stepahead.entrypoints.openai.serving_utils import (
    clamp,
    encode_ids,
    prompt_logprobs_json,
    sampling_params_of,
    token_text,
    truncate_prompt,
)
from stepahead.entrypoints.openai.template_sandbox import TemplateSandbox
from stepahead.entrypoints.openai.token_bytes import TokenBytes
from stepahead.entrypoints.openai.tool_calling.parsers.base import ToolCall, ToolStream, collect
from stepahead.entrypoints.openai.tool_calling.streams import finish_reason, tool_stream
from stepahead.entrypoints.openai.tool_calling.tools import ToolPlan, plan_tools
from stepahead.outputs import LOGPROB_FLOOR, Logprob
from stepahead.sampling_params import StructuredOutputsParams
from stepahead.validation import InvalidInputError, shorten

NO_TEMPLATE = ("As of transformers v4.44, default chat template is no longer allowed, so you must provide a "
               "chat template if the tokenizer does not define one.")


# Arguments render_chat passes to apply_chat_template itself.
RESERVED_TEMPLATE_KWARGS = {"conversation", "tokenize", "add_generation_prompt", "continue_final_message",
                            "return_dict", "return_tensors", "tools"}


def template_tool_call(call) -> dict:
    """An earlier call as templates expect it: arguments as an object where they parse (vLLM's rule)."""
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
                template_kwargs: dict | None, chat_template: str | None = None,
                sandbox: TemplateSandbox | None = None, tools: list[dict] | None = None) -> str:
    """The prompt text the chat template makes of the messages; 400 on anything it cannot render. A
    template the request brought (chat_template) renders in the sandbox's child process. CPU work that
    grows with the input: call it through Offload."""
    if add_generation_prompt and continue_final_message:
        raise APIError("continue_final_message and add_generation_prompt cannot both be true", 400,
                       "continue_final_message")
    if not getattr(tokenizer, "chat_template", None) and chat_template is None:
        raise APIError(NO_TEMPLATE, 400, "messages")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or {}))
    if reserved:
        raise APIError(f"chat_template_kwargs may not set {reserved}: the server sets them", 400, "chat_template_kwargs")
    conversation = []
    for index, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": _flatten_content(message, index)}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [template_tool_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        conversation.append(entry)
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k != "chat_template"}
    if tools:
        kwargs["tools"] = tools
    kwargs["add_generation_prompt"] = add_generation_prompt
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if chat_template is not None:
        if sandbox is None:
            raise APIError("chat templates from requests need the server's template sandbox", 400, "chat_template")
        return sandbox.render(conversation, chat_template, kwargs)
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    except APIError:
        raise
    except Exception as e:  # jinja2 errors and ValueErrors are the request's fault
        raise APIError(f"The chat template could not render these messages: {e}", 400, "messages") from e


def message_chars(messages: list[ChatMessage]) -> int:
    """Characters of the messages' text: a cheap bound on the prompt before rendering it."""
    total = 0
    for message in messages:
        if isinstance(message.content, str):
            total += len(message.content)
        elif message.content is not None:
            total += sum(len(part.text or "") for part in message.content)
        total += sum(len(call.function.arguments) + len(call.function.name) for call in message.tool_calls or ())
    return total


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The template's extra variables: reasoning_effort and documents (as vLLM passes them), then
    chat_template_kwargs, which may set them too."""
    server_set = {name: value for name, value in (("reasoning_effort", req.reasoning_effort),
                                                  ("documents", req.documents)) if value is not None}
    if not server_set:
        return req.chat_template_kwargs
    return server_set | (req.chat_template_kwargs or {})


def request_template(req: ChatCompletionRequest, trusted: bool) -> str | None:
    """The chat template the request brings (chat_template or chat_template_kwargs' chat_template), if
    the server trusts request templates; a 400 if it does not."""
    template = req.chat_template
    if template is None and req.chat_template_kwargs:
        template = req.chat_template_kwargs.get("chat_template")
    if template is not None and not trusted:
        raise APIError("chat templates from requests are refused: a template is code the server runs (start it with "
                       "--trust-request-chat-template to allow them)", 400, "chat_template")
    return template


def _flatten_content(message: ChatMessage, index: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise APIError(f"messages[{index}].content: only text parts are supported, got type {shorten(repr(part.type))}", 400,
                           "messages")
        texts.append(part.text)
    return "\n".join(texts)


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], top_n: int, decode,
                  raw_bytes: TokenBytes, as_ids: bool = False) -> ChatLogprobs:
    """as_ids: return_tokens_as_token_ids, tokens as "token_id:N" (bytes then those of that text, as vLLM)."""
    def token_bytes(token_id: int, text: str) -> list[int]:
        return list(text.encode()) if as_ids else list(raw_bytes(token_id))

    content = []
    for token_id, maybe_entry in zip(token_ids, entries, strict=False):
        entry = maybe_entry or {}  # chat never echoes prompt tokens: every entry is a sampled token's
        sampled = entry.get(token_id)
        token = token_text(token_id, sampled, decode, as_ids)
        top: list[TopLogprob] = []
        for other_id, other in sorted(entry.items(), key=lambda kv: kv[1].rank):
            if other.rank <= top_n and len(top) < top_n:
                text = token_text(other_id, other, decode, as_ids)
                top.append(TopLogprob(token=text, logprob=clamp(other.logprob), bytes=token_bytes(other_id, text)))
        content.append(ChatTokenLogprob(token=token, logprob=clamp(sampled.logprob) if sampled else LOGPROB_FLOOR,
                                        bytes=token_bytes(token_id, token), top_logprobs=top))
    return ChatLogprobs(content=content)


@dataclass
class _ChatChoice(Choice):
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)
    tools: ToolStream | None = None  # streaming: reads the output for tool calls
    reasoning: ReasoningStream | None = None  # streaming: splits off the reasoning
    called: bool = False  # streaming: a tool call delta went out


@dataclass
class _ChatContext(ResponseContext):
    tool_plan: ToolPlan | None = None
    echo: str = ""  # text every choice starts with (echo)
    reasoning_parser: str | None = None  # None: the output is not split
    reasoning_closed: bool = False  # the prompt closed the reasoning: the output is all content


def _echoed(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content when it is the assistant's (what
    continue_final_message continues), else nothing."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant":
        return ""
    return _flatten_content(last, len(req.messages) - 1)


class OpenAIServingChat(OpenAIServing):
    EMPTY_BODY = {"delta": {}}

    def __init__(self, *args, tool_parser: str | None = None, reasoning_parser: str | None = None, **kwargs) -> None:
        """tool_parser: a name in TOOL_PARSERS, for tool_choice "auto" (--enable-auto-tool-choice);
        reasoning_parser: a name in REASONING_PARSERS (--reasoning-parser)."""
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        # The token ids the engine's reasoning gate waits for before a grammar applies (vLLM's rule), and
        # whether the parsers' markers are special tokens the output must keep. Raises ValueError when the
        # tokenizer cannot write the parsers' markers (the server checks before the model loads).
        self.parser_tokens = parser_tokens(self.engine.tokenizer, tool_parser, reasoning_parser)
        self.token_bytes = TokenBytes(self.engine.tokenizer)
        self.template_sandbox = (TemplateSandbox(self.engine.config.model_config)
                                 if self.limits.trust_request_chat_template else None)

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        ctx, stream = await self.start(req)
        return await self.respond(ctx, stream, raw_request)

    async def start(self, req: ChatCompletionRequest) -> tuple[_ChatContext, RequestStream]:
        """Check, render and submit the request; its output is then read through `collect_response` or `chunks`."""
        model_name = self.check_request(req)
        # Checking the tools' schemas grows with them: off the event loop.
        plan = await self.offload.run(plan_tools, req.tools, req.tool_choice, req.parallel_tool_calls,
                                      self.tool_parser is not None) if req.tools else \
            plan_tools(None, req.tool_choice, None, False)
        top_logprobs = self._top_logprobs(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params_of(req, max_tokens, top_logprobs, self.generation_defaults, req.prompt_logprobs)
        if plan is not None and plan.constrained:
            if params.structured_outputs is not None:
                raise APIError(f"tool_choice {plan.mode!r} constrains the output itself: it cannot be combined with "
                               "response_format or structured_outputs", 400, "tool_choice")
            try:
                params.structured_outputs = StructuredOutputsParams(json=plan.schema())
                await self.check_grammar(req, params)
            except InvalidInputError as e:
                raise APIError(f"tools: the functions' parameter schemas cannot constrain the output: {e}", 400,
                               "tools") from None
        else:
            await self.check_grammar(req, params)
        self.limits.check_sequences(1, req.n)
        self.limits.check_chars(message_chars(req.messages), "messages")
        template = request_template(req, self.limits.trust_request_chat_template)
        tokenizer = self.engine.tokenizer
        text = await self.offload.run(render_chat, tokenizer, req.messages, req.add_generation_prompt,
                                      req.continue_final_message, template_kwargs(req), template,
                                      self.template_sandbox, req.tools)
        prompt_ids = await self.offload.run(encode_ids, tokenizer, text, req.add_special_tokens)
        kept = truncate_prompt(req, prompt_ids, self.model.max_model_len)
        prompt: dict = {"prompt_token_ids": kept} if kept is not prompt_ids else {"prompt_token_ids": kept, "prompt": text}
        prompt_ids = kept
        tokens = self.parser_tokens
        reasoning_closed = self.reasoning_parser is not None and \
            REASONING_PARSERS[self.reasoning_parser].closes_reasoning(text)
        if tokens.reasoning_end is not None and params.structured_outputs is not None and not reasoning_closed:
            # The model thinks freely; the grammar constrains only what follows its reasoning.
            params.structured_outputs.reasoning_end_token_ids = tokens.reasoning_end
            params.structured_outputs.reasoning_start_token_ids = tokens.reasoning_start
        if tokens.reasoning_keeps_special or (tokens.tools_keep_special and plan is not None and plan.mode == "auto"):
            params.skip_special_tokens = False  # the parsers read markers that are special tokens
        request_id = random_id("chatcmpl", req.request_id)
        try:
            stream = self.add_request(req, request_id, prompt, params)
        except InvalidInputError as e:
            if e.param == "logprobs":  # chat's name for the count
                raise APIError(f"top_{e}", 400, "top_logprobs") from None
            raise
        ctx = _ChatContext(request_id, model_name, int(time.time()), req, self.shown_logprobs(top_logprobs),
                           "chat.completion.chunk",
                           tool_plan=plan, echo=_echoed(req),
                           reasoning_parser=self.reasoning_parser, reasoning_closed=reasoning_closed)
        ctx.prompt_token_ids[request_id] = prompt_ids  # known before any output: the first chunk carries them
        return ctx, stream

    @staticmethod
    def _top_logprobs(req: ChatCompletionRequest) -> int | None:
        if not req.logprobs:
            if req.top_logprobs:
                raise APIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
            return None
        return req.top_logprobs or 0

    # -- hooks of OpenAIServing ----------------------------------------------------------------------

    def new_choice(self) -> _ChatChoice:
        return _ChatChoice()

    def first_deltas(self, ctx: _ChatContext) -> list[dict]:
        deltas = [{"index": index, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}
                  for index in range(ctx.req.n)]
        if ctx.echo:
            deltas += [{"index": index, "delta": {"content": ctx.echo}, "logprobs": None, "finish_reason": None}
                       for index in range(ctx.req.n)]
        return deltas

    def first_chunk_fields(self, ctx: ResponseContext) -> dict:
        return {"prompt_token_ids": ctx.prompt_token_ids[ctx.request_id]} if ctx.req.return_token_ids else {}

    def delta_body(self, ctx: _ChatContext, choice: _ChatChoice, text: str, final: bool) -> dict | None:
        delta: dict = {}
        if ctx.reasoning_parser is not None:  # reasoning first; what follows it is the content
            if choice.reasoning is None:
                choice.reasoning = REASONING_PARSERS[ctx.reasoning_parser](ctx.reasoning_closed)
            split_ = choice.reasoning.feed(text)
            if final:
                rest = choice.reasoning.finish()
                split_ = ReasoningDelta(split_.reasoning + rest.reasoning, split_.content + rest.content)
            if split_.reasoning and ctx.req.include_reasoning:
                delta["reasoning_content"] = split_.reasoning
            text = split_.content
        if ctx.tool_plan is not None and choice.tools is None:
            choice.tools = tool_stream(ctx.tool_plan, self.tool_parser)
        if choice.tools is None:
            if text:
                delta["content"] = text
        else:
            out = choice.tools.feed(text)
            if final:
                out += choice.tools.finish()
            if out.content:
                delta["content"] = out.content
            if out.tool_calls:
                delta["tool_calls"] = out.tool_calls
                choice.called = True
        return {"delta": delta} if delta or final else None

    def finish_reason(self, ctx: _ChatContext, choice: _ChatChoice, reason: str | None) -> str | None:
        return finish_reason(ctx.tool_plan, choice.called, reason)

    def logprobs_of(self, ctx: ResponseContext, choice: Choice, token_ids: list[int],
                    entries: list[dict[int, Logprob] | None], text: str) -> ChatLogprobs:
        return chat_logprobs(token_ids, entries, ctx.top_logprobs, self.engine.tokenizer.decode, self.token_bytes,
                             bool(ctx.req.return_tokens_as_token_ids))

    def keep_logprobs(self, choice: _ChatChoice, logprobs: ChatLogprobs) -> None:
        choice.logprobs.extend(logprobs.content or [])

    def response(self, ctx: _ChatContext, choices: list[tuple[int, _ChatChoice]],
                 usage_: dict) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model_name,
            choices=[self._choice(ctx, index, choice) for index, choice in choices],
            usage=UsageInfo(**usage_),
            prompt_logprobs=prompt_logprobs_json(ctx.prompt_logprobs.get(ctx.request_id))
            if ctx.req.prompt_logprobs is not None else None,
            prompt_token_ids=ctx.prompt_token_ids.get(ctx.request_id) if ctx.req.return_token_ids else None,
        )

    def _choice(self, ctx: _ChatContext, index: int, choice: _ChatChoice) -> ChatChoice:
        reasoning: str | None = None
        content: str | None = choice.text
        calls: list[ToolCall] = []
        if ctx.reasoning_parser is not None:
            reasoning, content = split_reasoning(REASONING_PARSERS[ctx.reasoning_parser](ctx.reasoning_closed),
                                                 content)
        stream = tool_stream(ctx.tool_plan, self.tool_parser)
        if stream is not None:
            content, calls = collect(stream, content)
        if ctx.echo:
            content = ctx.echo + (content or "")
        if not ctx.req.include_reasoning:
            reasoning = None
        return ChatChoice(index=index,
                          message=ChatResponseMessage(content=content, reasoning_content=reasoning,
                                                      tool_calls=[ChatToolCall.model_validate(c.to_openai()) for c in calls]),
                          logprobs=ChatLogprobs(content=choice.logprobs) if ctx.req.logprobs else None,
                          finish_reason=finish_reason(ctx.tool_plan, bool(calls), choice.finish_reason),
                          stop_reason=choice.stop_reason,
                          token_ids=choice.token_ids if ctx.req.return_token_ids else None)
