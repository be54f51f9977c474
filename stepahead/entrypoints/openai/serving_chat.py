"""POST /v1/chat/completions: messages through the model's chat template, n choices, streamed or not."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from stepahead.entrypoints.openai.errors import APIError
from stepahead.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from stepahead.entrypoints.openai.serving_base import Choice, OpenAIServing, ResponseContext
from stepahead.entrypoints.openai.serving_utils import clamp, encode_ids, sampling_params_of, token_text
from stepahead.entrypoints.openai.template_sandbox import TemplateSandbox
from stepahead.entrypoints.openai.token_bytes import TokenBytes
from stepahead.outputs import LOGPROB_FLOOR, Logprob
from stepahead.sampling_params import MAX_LOGPROBS
from stepahead.validation import shorten

NO_TEMPLATE = ("As of transformers v4.44, default chat template is no longer allowed, so you must provide a "
               "chat template if the tokenizer does not define one.")


# Arguments render_chat passes to apply_chat_template itself.
RESERVED_TEMPLATE_KWARGS = {"conversation", "tokenize", "add_generation_prompt", "continue_final_message",
                            "return_dict", "return_tensors"}


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
                template_kwargs: dict | None, chat_template: str | None = None,
                sandbox: TemplateSandbox | None = None) -> str:
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
        entry = {"role": message.role, "content": _flatten_content(message, index)}
        if message.name is not None:
            entry["name"] = message.name
        conversation.append(entry)
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k != "chat_template"}
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
    return total


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


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int, decode,
                  raw_bytes: TokenBytes) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        sampled = entry.get(token_id)
        token = token_text(token_id, sampled, decode)
        top: list[TopLogprob] = []
        for other_id, other in sorted(entry.items(), key=lambda kv: kv[1].rank):
            if other.rank <= top_n and len(top) < top_n:
                text = token_text(other_id, other, decode)
                top.append(TopLogprob(token=text, logprob=clamp(other.logprob), bytes=list(raw_bytes(other_id))))
        content.append(ChatTokenLogprob(token=token, logprob=clamp(sampled.logprob) if sampled else LOGPROB_FLOOR,
                                        bytes=list(raw_bytes(token_id)), top_logprobs=top))
    return ChatLogprobs(content=content)


@dataclass
class _ChatChoice(Choice):
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.token_bytes = TokenBytes(self.engine.tokenizer)
        self.template_sandbox = (TemplateSandbox(self.engine.config.model_config)
                                 if self.limits.trust_request_chat_template else None)

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        model_name = self.check_request(req)
        if req.tools:
            raise APIError("tools are not supported by this server", 400, "tools")
        top_logprobs = self._top_logprobs(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params_of(req, max_tokens, top_logprobs, self.generation_defaults)
        await self.check_grammar(req, params)
        self.limits.check_sequences(1, req.n)
        self.limits.check_chars(message_chars(req.messages), "messages")
        template = request_template(req, self.limits.trust_request_chat_template)
        tokenizer = self.engine.tokenizer
        text = await self.offload.run(render_chat, tokenizer, req.messages, req.add_generation_prompt,
                                      req.continue_final_message, req.chat_template_kwargs, template,
                                      self.template_sandbox)
        prompt_ids = await self.offload.run(encode_ids, tokenizer, text, req.add_special_tokens)
        request_id = random_id("chatcmpl")
        stream = self.add_request(req, request_id, {"prompt_token_ids": prompt_ids, "prompt": text}, params)
        ctx = ResponseContext(request_id, model_name, int(time.time()), req, top_logprobs, "chat.completion.chunk")
        return await self.respond(ctx, stream, raw_request)

    @staticmethod
    def _top_logprobs(req: ChatCompletionRequest) -> int | None:
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", 400, "top_logprobs")
        if not req.logprobs:
            if req.top_logprobs:
                raise APIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
            return None
        return req.top_logprobs or 0

    # -- hooks of OpenAIServing ----------------------------------------------------------------------

    def new_choice(self) -> _ChatChoice:
        return _ChatChoice()

    def first_deltas(self, ctx: ResponseContext) -> list[dict]:
        return [{"index": index, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}
                for index in range(ctx.req.n)]

    def delta_body(self, text: str) -> dict:
        return {"delta": {"content": text} if text else {}}

    def logprobs_of(self, ctx: ResponseContext, choice: Choice, token_ids: list[int],
                    entries: list[dict[int, Logprob]], text: str) -> ChatLogprobs:
        return chat_logprobs(token_ids, entries, ctx.top_logprobs, self.engine.tokenizer.decode, self.token_bytes)

    def keep_logprobs(self, choice: _ChatChoice, logprobs: ChatLogprobs) -> None:
        choice.logprobs.extend(logprobs.content or [])

    def response(self, ctx: ResponseContext, choices: list[tuple[int, _ChatChoice]],
                 usage_: dict) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model_name,
            choices=[ChatChoice(index=index, message=ChatResponseMessage(content=choice.text),
                                logprobs=ChatLogprobs(content=choice.logprobs) if ctx.req.logprobs else None,
                                finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)
                     for index, choice in choices],
            usage=UsageInfo(**usage_),
        )
