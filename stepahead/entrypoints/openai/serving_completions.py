"""POST /v1/completions: one or more prompts (text or token ids), n choices each, streamed or not."""

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
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
from stepahead.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class _Choice:
    """One choice being assembled (non-streaming) or streamed."""

    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    echoed: bool = False
    text_offset: int = 0
    # Tokens whose text has not been sent yet (an incomplete UTF-8 character): their logprobs wait.
    pending_ids: list[int] = field(default_factory=list)
    pending_lps: list[dict[int, Logprob]] = field(default_factory=list)
    logprobs: CompletionLogprobs | None = None


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int, offset: int,
                        decode) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy form: tokens, token_logprobs, top_logprobs (top-N plus the sampled token)."""
    out = CompletionLogprobs()
    for tid, entry in zip(token_ids, entries, strict=False):
        sampled = entry.get(tid)
        token = _token_text(tid, sampled, decode)
        out.tokens.append(token)
        out.token_logprobs.append(clamp(sampled.logprob) if sampled is not None else None)
        out.text_offset.append(offset)
        offset += len(token)
        top = {}
        for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank):
            if lp.rank <= top_n or t == tid:
                top[_token_text(t, lp, decode)] = clamp(lp.logprob)
        out.top_logprobs.append(top)
    return out, offset


def _token_text(tid: int, lp: Logprob | None, decode) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return decode([tid])


class OpenAIServingCompletion:
    def __init__(self, engine: AsyncLLM, model: ServedModel) -> None:
        self.engine = engine
        self.model = model

    async def create(self, req: CompletionRequest, raw_request: Request) -> Response:
        model_name = self.model.check(req.model)
        self.model.log_ignored_fields(req)
        reject_unsupported(req)
        if req.suffix:
            raise APIError("suffix is not currently supported", 400, "suffix")
        if req.echo and req.logprobs is not None:
            raise APIError("echo together with logprobs is not supported (no prompt logprobs)", 400, "echo")
        params = sampling_params_of(req, req.max_tokens, req.logprobs)
        prompts = _prompt_list(req)
        request_id = random_id("cmpl")
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = self._submit(ids, prompts, params, req.add_special_tokens)
        ctx = _Ctx(request_id, model_name, int(time.time()), req, {rid: i for i, rid in enumerate(ids)})
        if req.stream:
            return SSEResponse(self._stream(ctx, stream))
        return await with_cancellation(raw_request, self._collect(ctx, stream))

    def _submit(self, ids: list[str], prompts: list, params, add_special_tokens: bool) -> RequestStream:
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

    def _prompt_text(self, ro: RequestOutput) -> str:
        return ro.prompt if ro.prompt is not None else self.engine.tokenizer.decode(ro.prompt_token_ids)

    # -- non-streaming -----------------------------------------------------------------------------

    async def _collect(self, ctx: _Ctx, stream: RequestStream) -> JSONResponse:
        n = ctx.req.n
        choices: dict[int, _Choice] = {}
        prompt_tokens: dict[int, int] = {}
        async with contextlib.aclosing(self.engine.stream_outputs(stream)) as outputs:
            async for ro in outputs:
                p = ctx.prompt_index[ro.request_id]
                prompt_tokens[p] = len(ro.prompt_token_ids)
                for co in ro.outputs:
                    check_finish(co.finish_reason, co.stop_reason)
                    ch = choices.setdefault(p * n + co.index, _Choice())
                    if ctx.req.echo and not ch.echoed:
                        ch.text, ch.echoed = self._prompt_text(ro), True
                    self._add_logprobs(ctx, ch, co, flush=True)
                    ch.text += co.text
                    ch.num_tokens += len(co.token_ids)
                    ch.finish_reason, ch.stop_reason = co.finish_reason, co.stop_reason
        resp = CompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model_name,
            choices=[CompletionChoice(index=i, text=c.text, logprobs=c.logprobs, finish_reason=c.finish_reason,
                                      stop_reason=c.stop_reason) for i, c in sorted(choices.items())],
            usage=UsageInfo(**usage(sum(prompt_tokens.values()), sum(c.num_tokens for c in choices.values()))),
        )
        return JSONResponse(resp.model_dump(mode="json"))

    def _add_logprobs(self, ctx: _Ctx, ch: _Choice, co: CompletionOutput, flush: bool) -> CompletionLogprobs | None:
        """Queue this delta's logprobs; return those ready to send. flush (non-streaming): take all, keep them."""
        if ctx.req.logprobs is None or co.logprobs is None:
            return None
        ch.pending_ids.extend(co.token_ids)
        ch.pending_lps.extend(co.logprobs)
        if not (flush or co.text or co.finish_reason is not None):
            return None
        lp, ch.text_offset = completion_logprobs(ch.pending_ids, ch.pending_lps, ctx.req.logprobs,
                                                 ch.text_offset, self.engine.tokenizer.decode)
        ch.pending_ids, ch.pending_lps = [], []
        if flush:
            if ch.logprobs is None:
                ch.logprobs = CompletionLogprobs()
            for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                getattr(ch.logprobs, name).extend(getattr(lp, name))
        return lp

    # -- streaming ---------------------------------------------------------------------------------

    async def _stream(self, ctx: _Ctx, stream: RequestStream) -> AsyncIterator[str]:
        n = ctx.req.n
        choices: dict[int, _Choice] = {}
        prompt_tokens: dict[int, int] = {}
        try:
            async with contextlib.aclosing(self.engine.stream_outputs(stream)) as outputs:
                async for ro in outputs:
                    p = ctx.prompt_index[ro.request_id]
                    prompt_tokens[p] = len(ro.prompt_token_ids)
                    for co in ro.outputs:
                        check_finish(co.finish_reason, co.stop_reason)
                        index = p * n + co.index
                        ch = choices.setdefault(index, _Choice())
                        ch.num_tokens += len(co.token_ids)
                        text = co.text
                        if ctx.req.echo and not ch.echoed:
                            text, ch.echoed = self._prompt_text(ro) + text, True
                        lp = self._add_logprobs(ctx, ch, co, flush=False)
                        if not text and co.finish_reason is None:
                            continue  # no empty deltas
                        yield sse(ctx.chunk([{
                            "index": index, "text": text,
                            "logprobs": None if lp is None else lp.model_dump(mode="json"),
                            "finish_reason": co.finish_reason, "stop_reason": co.stop_reason,
                        }]))
            so = ctx.req.stream_options
            if so is not None and so.include_usage:
                yield sse(ctx.chunk([], usage(sum(prompt_tokens.values()), sum(c.num_tokens for c in choices.values()))))
        except Exception as e:  # noqa: BLE001 - after the 200 header an error can only be an event
            yield sse_error(e)
        yield SSE_DONE


@dataclass
class _Ctx:
    request_id: str
    model_name: str
    created: int
    req: CompletionRequest
    prompt_index: dict[str, int]

    def chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        out = {"id": self.request_id, "object": "text_completion", "created": self.created,
               "model": self.model_name, "choices": choices}
        if usage_ is not None:
            out["usage"] = usage_
        return out


def _prompt_list(req: CompletionRequest) -> list:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError("prompt must not be empty", 400, "prompt")
    if isinstance(p[0], int):
        return [list(p)]
    return list(p)
