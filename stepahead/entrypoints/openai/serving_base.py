"""OpenAIServing: the request -> engine -> response flow that completions and chat share.

A handler validates the request and submits it; this class then reads the engine's deltas and either
assembles one JSON response or streams them as server-sent events. The endpoints differ only in how a
choice is indexed, what text a delta carries, the logprobs format and the final response model:
those are the hooks a subclass fills in.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from stepahead.engine.async_llm import AsyncLLM, RequestStream
from stepahead.engine.input_processor import PromptType
from stepahead.entrypoints.openai.errors import APIError
from stepahead.entrypoints.openai.protocol import SamplingFields
from stepahead.entrypoints.openai.request_limits import Offload, RequestLimits
from stepahead.entrypoints.openai.serving_utils import (
    SSE_DONE,
    ServedModel,
    SSEResponse,
    check_finish,
    grammar_param,
    reject_unsupported,
    sse,
    sse_error,
    usage,
    with_cancellation,
)
from stepahead.outputs import CompletionOutput, Logprob, RequestOutput
from stepahead.sampling_params import SamplingParams
from stepahead.validation import InvalidInputError

# A streamed delta with more tokens' logprobs than this (an echoed prompt's) has them converted off the
# event loop; a decode step's few are converted in place.
INLINE_LOGPROB_TOKENS = 64


@dataclass
class Choice:
    """One choice being assembled (non-streaming) or streamed."""

    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Tokens whose text has not been sent yet (an incomplete UTF-8 character): their logprobs wait.
    pending_ids: list[int] = field(default_factory=list)
    pending_lps: list[dict[int, Logprob] | None] = field(default_factory=list)
    request_id: str = ""  # the engine request the choice is a completion of
    token_ids: list[int] = field(default_factory=list)  # the output's ids, for return_token_ids


@dataclass
class ResponseContext:
    """What every chunk and the response of one HTTP request carry."""

    request_id: str
    model_name: str
    created: int
    req: Any  # the endpoint's request model
    top_logprobs: int | None  # None: no logprobs were asked for
    chunk_object: str  # the "object" of a streamed chunk
    # Engine request id -> its prompt logprobs (SamplingParams.prompt_logprobs), once they arrived.
    prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] = field(default_factory=dict)
    # Engine request id -> its prompt's token ids (return_token_ids).
    prompt_token_ids: dict[str, list[int]] = field(default_factory=dict)

    def chunk(self, choices: list[dict], usage_: dict | None = None, top: dict | None = None) -> dict:
        """top: fields of the chunk itself, besides the choices (chat's prompt_token_ids on the first)."""
        out = {"id": self.request_id, "object": self.chunk_object, "created": self.created,
               "model": self.model_name, **(top or {}), "choices": choices}
        if usage_ is not None:
            out["usage"] = usage_
        return out


class OpenAIServing:
    EMPTY_BODY: dict = {}  # a streamed choice's text fields when it has no text (logprobs waiting on a character)

    def __init__(self, engine: AsyncLLM, model: ServedModel, limits: RequestLimits, offload: Offload,
                 prompt_tokens_details: bool = False, tokens_as_ids: bool = False) -> None:
        """prompt_tokens_details: usage says how many prompt tokens the prefix cache held
        (--enable-prompt-tokens-details). tokens_as_ids: a request's return_tokens_as_token_ids when it
        does not say (--return-tokens-as-token-ids)."""
        self.engine = engine
        self.prompt_tokens_details = prompt_tokens_details
        self.tokens_as_ids = tokens_as_ids
        self.model = model
        self.limits = limits
        self.offload = offload  # tokenizing and chat templates run here, off the event loop
        self.generation_defaults = engine.config.model_config.generation_defaults

    def check_request(self, req: SamplingFields) -> str:
        """The model name to answer with, after the checks every endpoint makes."""
        model_name = self.model.check(req.model)
        self.model.log_ignored_fields(req)
        reject_unsupported(req)
        if req.return_tokens_as_token_ids is None:
            req.return_tokens_as_token_ids = self.tokens_as_ids
        if req.bad_words:  # tokenized on the event loop with the prompt's checks: bounded like a prompt
            self.limits.check_chars(sum(len(word) for word in req.bad_words), "bad_words", "bad_words have")
        return model_name

    def shown_logprobs(self, asked: int | None) -> int | None:
        """How many top logprobs a response lists per token: -1 is the whole vocabulary."""
        return self.engine.model_config.vocab_size if asked == -1 else asked

    async def check_grammar(self, req: SamplingFields, params: SamplingParams) -> None:
        """Parse the request's grammar on a worker thread under the parse time limit, so a large
        schema never holds the event loop; the engine's own check of it is then a lookup."""
        if params.structured_outputs is None:
            return
        limit = self.limits.grammar_parse_timeout_s
        try:
            await asyncio.wait_for(self.offload.run(self.engine.input_processor.check_structured_outputs, params),
                                   limit)
        except asyncio.TimeoutError:
            raise APIError(f"structured_outputs: the grammar took longer than {limit:g} s to parse (the limit)",
                           400, grammar_param(req)) from None
        except InvalidInputError as e:
            e.param = grammar_param(req) if e.param == "structured_outputs" else e.param
            raise

    def add_request(self, req: SamplingFields, request_id: str, prompt: PromptType, params: SamplingParams,
                    stream: RequestStream | None = None) -> RequestStream:
        """Submit one prompt; a rejection names the field the client sent."""
        try:
            return self.engine.add_request(request_id, prompt, params, stream, priority=req.priority,
                                           cache_salt=req.cache_salt)
        except InvalidInputError as e:
            e.param = grammar_param(req) if e.param == "structured_outputs" else e.param
            raise

    async def respond(self, ctx: ResponseContext, stream: RequestStream, raw_request: Request) -> Response:
        if ctx.req.stream:
            return SSEResponse(self._stream(ctx, stream))
        return await with_cancellation(raw_request, self._collect(ctx, stream))

    # -- hooks -------------------------------------------------------------------------------------

    def new_choice(self) -> Choice:
        return Choice()

    def choice_index(self, ctx: ResponseContext, request_output: RequestOutput,
                     completion: CompletionOutput) -> int:
        return completion.index

    def delta_text(self, ctx: ResponseContext, choice: Choice, request_output: RequestOutput,
                   completion: CompletionOutput) -> str:
        """The text this delta adds to the choice."""
        return completion.text

    def visible_completion(self, ctx: ResponseContext, completion: CompletionOutput) -> CompletionOutput:
        """The completion as the client sees it (completions' echo-only requests hide the sampled token)."""
        return completion

    def delta_body(self, ctx: ResponseContext, choice: Choice, text: str, final: bool) -> dict | None:
        """The endpoint's text field(s) of a streamed choice; None: nothing to send yet. final: the choice's
        last delta."""
        raise NotImplementedError

    def finish_reason(self, ctx: ResponseContext, choice: Choice, reason: str | None) -> str | None:
        """The finish_reason the client sees (chat reports tool calls as "tool_calls")."""
        return reason

    def first_deltas(self, ctx: ResponseContext) -> list[dict]:
        """Streamed choices sent before any output."""
        return []

    def first_chunk_fields(self, ctx: ResponseContext) -> dict:
        """Fields of the first of first_deltas' chunks itself."""
        return {}

    def first_choice_fields(self, ctx: ResponseContext, request_id: str) -> dict:
        """Fields of a streamed choice's first chunk (completions' prompt_token_ids)."""
        return {}

    def logprobs_of(self, ctx: ResponseContext, choice: Choice, token_ids: list[int],
                    entries: list[dict[int, Logprob] | None], text: str) -> BaseModel:
        """The logprobs of token_ids, whose text is `text` (the delta being sent with them)."""
        raise NotImplementedError

    def keep_logprobs(self, choice: Choice, logprobs: BaseModel) -> None:
        """Non-streaming: add a delta's logprobs to the choice's."""
        raise NotImplementedError

    def response(self, ctx: ResponseContext, choices: list[tuple[int, Choice]], usage_: dict) -> BaseModel:
        raise NotImplementedError

    # -- the flow ----------------------------------------------------------------------------------

    def _take_logprobs(self, ctx: ResponseContext, choice: Choice, completion: CompletionOutput, text: str,
                       flush: bool) -> BaseModel | None:
        """Queue this delta's logprobs; return those of the tokens whose text (`text`) is being sent."""
        if ctx.top_logprobs is None or completion.logprobs is None:
            return None
        choice.pending_ids.extend(completion.token_ids)
        choice.pending_lps.extend(completion.logprobs)
        if not (flush or text or completion.finish_reason is not None):
            return None
        # The pending tokens' text (earlier deltas held none) is this delta's.
        logprobs = self.logprobs_of(ctx, choice, choice.pending_ids, choice.pending_lps, text)
        choice.pending_ids, choice.pending_lps = [], []
        return logprobs

    async def _deltas(self, ctx: ResponseContext, stream: RequestStream,
                      prompts: dict[str, tuple[int, int]]) -> AsyncGenerator[tuple[RequestOutput, CompletionOutput], None]:
        """Every choice delta of the stream; records each prompt's length, cached tokens and prompt
        logprobs; a failed choice raises."""
        async with contextlib.aclosing(self.engine.stream_outputs(stream)) as outputs:
            async for request_output in outputs:
                cached = max(request_output.num_cached_tokens, prompts.get(request_output.request_id, (0, 0))[1])
                prompts[request_output.request_id] = (len(request_output.prompt_token_ids), cached)
                ctx.prompt_token_ids.setdefault(request_output.request_id, request_output.prompt_token_ids)
                if request_output.prompt_logprobs is not None:
                    ctx.prompt_logprobs[request_output.request_id] = request_output.prompt_logprobs
                for completion in request_output.outputs:
                    check_finish(completion.finish_reason, completion.stop_reason)
                    yield request_output, self.visible_completion(ctx, completion)

    async def _collect(self, ctx: ResponseContext, stream: RequestStream) -> JSONResponse:
        deltas, prompts = await self._gather(ctx, stream)
        return await self.offload.run(self._json_response, ctx, deltas, prompts)

    def _json_response(self, ctx: ResponseContext, deltas: list[tuple[RequestOutput, CompletionOutput]],
                       prompts: dict[str, tuple[int, int]]) -> JSONResponse:
        return JSONResponse(self._assemble(ctx, deltas, prompts).model_dump(mode="json"))

    async def collect_response(self, ctx: ResponseContext, stream: RequestStream) -> BaseModel:
        """The whole response, once every choice has finished."""
        deltas, prompts = await self._gather(ctx, stream)
        return await self.offload.run(self._assemble, ctx, deltas, prompts)

    async def _gather(self, ctx: ResponseContext, stream: RequestStream
                      ) -> tuple[list[tuple[RequestOutput, CompletionOutput]], dict[str, tuple[int, int]]]:
        """Every delta of the stream, kept as it came: building the response from them (logprobs of every
        token, an echoed prompt's, prompt_logprobs, then the JSON) grows with the prompt and the output,
        so `_assemble` runs it off the event loop."""
        prompts: dict[str, tuple[int, int]] = {}
        async with contextlib.aclosing(self._deltas(ctx, stream, prompts)) as deltas:
            return [delta async for delta in deltas], prompts

    def _assemble(self, ctx: ResponseContext, deltas: list[tuple[RequestOutput, CompletionOutput]],
                  prompts: dict[str, tuple[int, int]]) -> BaseModel:
        choices: dict[int, Choice] = {}
        for request_output, completion in deltas:
            choice = choices.setdefault(self.choice_index(ctx, request_output, completion), self.new_choice())
            choice.request_id = request_output.request_id
            text = self.delta_text(ctx, choice, request_output, completion)
            logprobs = self._take_logprobs(ctx, choice, completion, text, flush=True)
            if logprobs is not None:
                self.keep_logprobs(choice, logprobs)
            choice.text += text
            choice.num_tokens += len(completion.token_ids)
            if ctx.req.return_token_ids:
                choice.token_ids.extend(completion.token_ids)
            choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason
        return self.response(ctx, sorted(choices.items()), self._usage(prompts, choices))

    async def _stream(self, ctx: ResponseContext, stream: RequestStream) -> AsyncGenerator[str, None]:
        try:
            async with contextlib.aclosing(self.chunks(ctx, stream)) as chunks:
                async for chunk in chunks:
                    yield sse(chunk)
        except Exception as e:  # after the 200 header an error can only be an event
            yield sse_error(e)
        yield SSE_DONE

    async def chunks(self, ctx: ResponseContext, stream: RequestStream) -> AsyncGenerator[dict, None]:
        """The streamed chunks' payloads, the usage chunk last when asked for; an error raises."""
        choices: dict[int, Choice] = {}
        prompts: dict[str, tuple[int, int]] = {}
        stream_options = ctx.req.stream_options
        include_usage = stream_options is not None and bool(stream_options.include_usage)
        # vLLM's continuous_usage_stats: every chunk after the first output carries the usage so far.
        continuous = include_usage and bool(stream_options.continuous_usage_stats)
        # Chunks before any output: with continuous usage they count the prompt (chat knows it by now).
        before = self._usage({rid: (len(ids), 0) for rid, ids in ctx.prompt_token_ids.items()}, {}) \
            if continuous else None
        for i, delta in enumerate(self.first_deltas(ctx)):
            yield ctx.chunk([delta], before, top=None if i else self.first_chunk_fields(ctx))
        async with contextlib.aclosing(self._deltas(ctx, stream, prompts)) as deltas:
            async for request_output, completion in deltas:
                index = self.choice_index(ctx, request_output, completion)
                first = index not in choices
                choice = choices.setdefault(index, self.new_choice())
                choice.request_id = request_output.request_id
                choice.num_tokens += len(completion.token_ids)
                text = self.delta_text(ctx, choice, request_output, completion)
                if len(completion.logprobs or ()) > INLINE_LOGPROB_TOKENS:  # an echoed prompt's: off the loop
                    logprobs = await self.offload.run(self._take_logprobs, ctx, choice, completion, text, False)
                else:
                    logprobs = self._take_logprobs(ctx, choice, completion, text, flush=False)
                final = completion.finish_reason is not None
                body = self.delta_body(ctx, choice, text, final)
                if ctx.req.return_token_ids:
                    choice.token_ids.extend(completion.token_ids)
                if body is None and logprobs is None and not final:
                    continue  # no empty deltas; the held tokens' ids go with the next chunk
                ids: dict = {}
                if ctx.req.return_token_ids:
                    ids = {**(self.first_choice_fields(ctx, request_output.request_id) if first else {}),
                           "token_ids": choice.token_ids}
                    choice.token_ids = []
                yield ctx.chunk([{
                    "index": index, **(body if body is not None else self.EMPTY_BODY),
                    "logprobs": None if logprobs is None else logprobs.model_dump(mode="json"),
                    "finish_reason": self.finish_reason(ctx, choice, completion.finish_reason),
                    "stop_reason": completion.stop_reason, **ids,
                }], self._usage(prompts, choices) if continuous else None)
        if include_usage:
            yield ctx.chunk([], self._usage(prompts, choices))

    def _usage(self, prompts: dict[str, tuple[int, int]], choices: dict[int, Choice]) -> dict:
        out = usage(sum(n for n, _ in prompts.values()), sum(choice.num_tokens for choice in choices.values()))
        if self.prompt_tokens_details:
            out["prompt_tokens_details"] = {"cached_tokens": sum(cached for _, cached in prompts.values())}
        return out
