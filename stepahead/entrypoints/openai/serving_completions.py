"""POST /v1/completions: one or more prompts (text or token ids), n choices each, streamed or not."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from stepahead.engine.async_llm import RequestStream
from stepahead.entrypoints.openai.errors import APIError
from stepahead.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from stepahead.entrypoints.openai.serving_base import Choice, OpenAIServing, ResponseContext
from stepahead.entrypoints.openai.serving_utils import clamp, sampling_params_of, token_text
from stepahead.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class _CompletionChoice(Choice):
    echoed: bool = False
    text_offset: int = 0
    logprobs: CompletionLogprobs | None = None


@dataclass
class _CompletionContext(ResponseContext):
    prompt_index: dict[str, int]  # engine request id -> its prompt's position


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int, offset: int,
                        decode) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy form: tokens, token_logprobs, top_logprobs (top-N plus the sampled token)."""
    out = CompletionLogprobs()
    for tid, entry in zip(token_ids, entries, strict=False):
        sampled = entry.get(tid)
        token = token_text(tid, sampled, decode)
        out.tokens.append(token)
        out.token_logprobs.append(clamp(sampled.logprob) if sampled is not None else None)
        out.text_offset.append(offset)
        offset += len(token)
        top = {}
        for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank):
            if lp.rank <= top_n or t == tid:
                top[token_text(t, lp, decode)] = clamp(lp.logprob)
        out.top_logprobs.append(top)
    return out, offset


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw_request: Request) -> Response:
        model_name = self.check_request(req)
        if req.suffix:
            raise APIError("suffix is not currently supported", 400, "suffix")
        if req.echo and req.logprobs is not None:
            raise APIError("echo together with logprobs is not supported (no prompt logprobs)", 400, "echo")
        params = sampling_params_of(req, req.max_tokens, req.logprobs)
        prompts = _prompt_list(req)
        request_id = random_id("cmpl")
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = self._submit(ids, prompts, params, req.add_special_tokens)
        ctx = _CompletionContext(request_id, model_name, int(time.time()), req, req.logprobs, "text_completion",
                                 prompt_index={rid: i for i, rid in enumerate(ids)})
        return await self.respond(ctx, stream, raw_request)

    def _submit(self, ids: list[str], prompts: list, params, add_special_tokens: bool) -> RequestStream:
        """All prompts into one stream; if one is rejected, those already added are aborted."""
        stream = None
        try:
            for rid, prompt in zip(ids, prompts, strict=True):
                if isinstance(prompt, str):
                    text = prompt
                    prompt = {"prompt_token_ids": self._encode(prompt, add_special_tokens), "prompt": text}
                stream = self.engine.add_request(rid, prompt, params, stream)
        except BaseException:
            for rid in stream.request_ids if stream is not None else []:
                self.engine.abort(rid)
            raise
        return stream

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if not text:
            raise APIError("prompt must not be empty", 400, "prompt")
        return list(self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    # -- hooks of OpenAIServing ----------------------------------------------------------------------

    def new_choice(self) -> _CompletionChoice:
        return _CompletionChoice()

    def choice_index(self, ctx: _CompletionContext, ro: RequestOutput, co: CompletionOutput) -> int:
        return ctx.prompt_index[ro.request_id] * ctx.req.n + co.index

    def delta_text(self, ctx: ResponseContext, ch: _CompletionChoice, ro: RequestOutput, co: CompletionOutput) -> str:
        if ctx.req.echo and not ch.echoed:  # the prompt goes before the choice's first text
            ch.echoed = True
            prompt = ro.prompt if ro.prompt is not None else self.engine.tokenizer.decode(ro.prompt_token_ids)
            return prompt + co.text
        return co.text

    def delta_body(self, text: str) -> dict:
        return {"text": text}

    def logprobs_of(self, ctx: ResponseContext, ch: _CompletionChoice, token_ids: list[int],
                    entries: list[dict[int, Logprob]]) -> CompletionLogprobs:
        lp, ch.text_offset = completion_logprobs(token_ids, entries, ctx.top_logprobs, ch.text_offset,
                                                 self.engine.tokenizer.decode)
        return lp

    def keep_logprobs(self, ch: _CompletionChoice, lp: CompletionLogprobs) -> None:
        if ch.logprobs is None:
            ch.logprobs = CompletionLogprobs()
        for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
            getattr(ch.logprobs, name).extend(getattr(lp, name))

    def response(self, ctx: ResponseContext, choices: list[tuple[int, _CompletionChoice]],
                 usage_: dict) -> CompletionResponse:
        return CompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model_name,
            choices=[CompletionChoice(index=i, text=c.text, logprobs=c.logprobs, finish_reason=c.finish_reason,
                                      stop_reason=c.stop_reason) for i, c in choices],
            usage=UsageInfo(**usage_),
        )


def _prompt_list(req: CompletionRequest) -> list:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError("prompt must not be empty", 400, "prompt")
    if isinstance(p[0], int):
        return [list(p)]
    return list(p)
