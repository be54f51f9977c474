"""POST /v1/chat/completions: messages through the model's chat template, n choices, streamed or not."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from stepahead.engine.async_llm import AsyncLLM, RequestStream
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
from stepahead.entrypoints.openai.serving_utils import (
    SSE_DONE,
    ServedModel,
    SSEResponse,
    check_finish,
    clamp,
    reject_unsupported,
    sampling_params_of,
    sse,
    sse_error,
    usage,
    with_cancellation,
)
from stepahead.outputs import CompletionOutput, Logprob
from stepahead.sampling_params import MAX_LOGPROBS

NO_TEMPLATE = ("As of transformers v4.44, default chat template is no longer allowed, so you must provide a "
               "chat template if the tokenizer does not define one.")


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
                template_kwargs: dict | None) -> str:
    """The prompt text the chat template makes of the messages; 400 on anything it cannot render."""
    if add_generation_prompt and continue_final_message:
        raise APIError("continue_final_message and add_generation_prompt cannot both be true", 400,
                       "continue_final_message")
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(NO_TEMPLATE, 400, "messages")
    conversation = []
    for i, m in enumerate(messages):
        entry = {"role": m.role, "content": _flatten_content(m, i)}
        if m.name is not None:
            entry["name"] = m.name
        conversation.append(entry)
    kwargs = dict(template_kwargs or {})
    if continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja2 errors and ValueErrors are the request's fault
        raise APIError(f"The chat template could not render these messages: {e}", 400, "messages") from e


def _flatten_content(m: ChatMessage, i: int) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    texts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise APIError(f"messages[{i}].content: only text parts are supported, got type {part.type!r}", 400,
                           "messages")
        texts.append(part.text)
    return "\n".join(texts)


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int, decode) -> ChatLogprobs:
    content = []
    for tid, entry in zip(token_ids, entries, strict=False):
        sampled = entry.get(tid)
        token = _text(tid, sampled, decode)
        top = [TopLogprob(token=_text(t, lp, decode), logprob=clamp(lp.logprob), bytes=list(_text(t, lp, decode).encode()))
               for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank) if lp.rank <= top_n][:top_n]
        content.append(ChatTokenLogprob(token=token, logprob=clamp(sampled.logprob) if sampled else LOGPROB_NONE,
                                        bytes=list(token.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


LOGPROB_NONE = -9999.0


def _text(tid: int, lp: Logprob | None, decode) -> str:
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else decode([tid])


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)
    pending_ids: list[int] = field(default_factory=list)
    pending_lps: list[dict[int, Logprob]] = field(default_factory=list)


class OpenAIServingChat:
    def __init__(self, engine: AsyncLLM, model: ServedModel) -> None:
        self.engine = engine
        self.model = model

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        model_name = self.model.check(req.model)
        self.model.log_ignored_fields(req)
        reject_unsupported(req)
        if req.tools:
            raise APIError("tools are not supported by this server", 400, "tools")
        top_logprobs = self._top_logprobs(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params_of(req, max_tokens, top_logprobs)
        text = render_chat(self.engine.tokenizer, req.messages, req.add_generation_prompt,
                           req.continue_final_message, req.chat_template_kwargs)
        prompt_ids = list(self.engine.tokenizer.encode(text, add_special_tokens=req.add_special_tokens))
        request_id = random_id("chatcmpl")
        stream = self.engine.add_request(request_id, {"prompt_token_ids": prompt_ids, "prompt": text}, params)
        created = int(time.time())
        if req.stream:
            return SSEResponse(self._stream(req, request_id, model_name, created, stream))
        return await with_cancellation(raw_request, self._collect(req, request_id, model_name, created, stream))

    @staticmethod
    def _top_logprobs(req: ChatCompletionRequest) -> int | None:
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", 400, "top_logprobs")
        if not req.logprobs:
            if req.top_logprobs:
                raise APIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
            return None
        return req.top_logprobs or 0

    def _take_logprobs(self, req: ChatCompletionRequest, ch: _Choice, co: CompletionOutput,
                       flush: bool) -> ChatLogprobs | None:
        """Logprobs of the tokens whose text is being sent (tokens of an unfinished character wait)."""
        if not req.logprobs or co.logprobs is None:
            return None
        ch.pending_ids.extend(co.token_ids)
        ch.pending_lps.extend(co.logprobs)
        if not (flush or co.text or co.finish_reason is not None):
            return None
        lp = chat_logprobs(ch.pending_ids, ch.pending_lps, req.top_logprobs or 0, self.engine.tokenizer.decode)
        ch.pending_ids, ch.pending_lps = [], []
        return lp

    async def _collect(self, req, request_id: str, model_name: str, created: int,
                       stream: RequestStream) -> JSONResponse:
        choices = {i: _Choice() for i in range(req.n)}
        prompt_tokens = 0
        async with contextlib.aclosing(self.engine.stream_outputs(stream)) as outputs:
            async for ro in outputs:
                prompt_tokens = len(ro.prompt_token_ids)
                for co in ro.outputs:
                    check_finish(co.finish_reason, co.stop_reason)
                    ch = choices[co.index]
                    lp = self._take_logprobs(req, ch, co, flush=True)
                    if lp is not None:
                        ch.logprobs.extend(lp.content or [])
                    ch.text += co.text
                    ch.num_tokens += len(co.token_ids)
                    ch.finish_reason, ch.stop_reason = co.finish_reason, co.stop_reason
        resp = ChatCompletionResponse(
            id=request_id, created=created, model=model_name,
            choices=[ChatChoice(index=i, message=ChatResponseMessage(content=c.text),
                                logprobs=ChatLogprobs(content=c.logprobs) if req.logprobs else None,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                     for i, c in sorted(choices.items())],
            usage=UsageInfo(**usage(prompt_tokens, sum(c.num_tokens for c in choices.values()))),
        )
        return JSONResponse(resp.model_dump(mode="json"))

    async def _stream(self, req, request_id: str, model_name: str, created: int,
                      stream: RequestStream) -> AsyncIterator[str]:
        def chunk(choices: list[dict], usage_: dict | None = None) -> str:
            out = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_name,
                   "choices": choices}
            if usage_ is not None:
                out["usage"] = usage_
            return sse(out)

        choices = {i: _Choice() for i in range(req.n)}
        prompt_tokens = 0
        try:
            for i in range(req.n):
                yield chunk([{"index": i, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}])
            async with contextlib.aclosing(self.engine.stream_outputs(stream)) as outputs:
                async for ro in outputs:
                    prompt_tokens = len(ro.prompt_token_ids)
                    for co in ro.outputs:
                        check_finish(co.finish_reason, co.stop_reason)
                        ch = choices[co.index]
                        ch.num_tokens += len(co.token_ids)
                        lp = self._take_logprobs(req, ch, co, flush=False)
                        if not co.text and co.finish_reason is None:
                            continue  # no empty deltas
                        yield chunk([{
                            "index": co.index, "delta": {"content": co.text} if co.text else {},
                            "logprobs": None if lp is None else lp.model_dump(mode="json"),
                            "finish_reason": co.finish_reason, "stop_reason": co.stop_reason,
                        }])
            so = req.stream_options
            if so is not None and so.include_usage:
                yield chunk([], usage(prompt_tokens, sum(c.num_tokens for c in choices.values())))
        except Exception as e:  # noqa: BLE001 - after the 200 header an error can only be an event
            yield sse_error(e)
        yield SSE_DONE
