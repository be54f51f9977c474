"""POST /v1/completions: one or more prompts (text or token ids), n choices each, streamed or not."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
from stepahead.entrypoints.openai.serving_utils import (
    clamp,
    encode_ids,
    prompt_logprobs_json,
    sampling_params_of,
    token_text,
    truncate_prompt,
)
from stepahead.outputs import CompletionOutput, Logprob, RequestOutput
from stepahead.sampling_params import SamplingParams


@dataclass
class _CompletionChoice(Choice):
    echoed: bool = False
    text_offset: int = 0
    logprobs: CompletionLogprobs | None = None


@dataclass
class _CompletionContext(ResponseContext):
    prompt_index: dict[str, int] = field(default_factory=dict)  # engine request id -> its prompt's position
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, one token sampled and not shown


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], top_n: int, offset: int,
                        decode, text: str, as_ids: bool = False) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy form: tokens, token_logprobs, top_logprobs (the sampled token, then the top-N).

    text is the returned text these tokens produced, starting at offset: each token's text_offset
    indexes it (the length of its predecessors' decoded text, never past the text's end, since a token
    holding part of a character decodes to U+FFFD alone); returns the offset after text. An entry
    None (an echoed prompt's first token, which nothing predicts) has no logprob and no top list."""
    result = CompletionLogprobs()
    for j, (token_id, entry) in enumerate(zip(token_ids, entries, strict=False)):
        sampled = entry.get(token_id) if entry is not None else None
        token = token_text(token_id, sampled, decode, as_ids)
        result.tokens.append(token)
        result.token_logprobs.append(clamp(sampled.logprob) if sampled is not None else None)
        result.text_offset.append(offset + min(len(decode(token_ids[:j])) if j else 0, len(text)))
        if entry is None:
            result.top_logprobs.append(None)
            continue
        # The sampled token first, then the rest by rank (vLLM's order: a client's first key is the token).
        top = {token: clamp(sampled.logprob)} if sampled is not None else {}
        for other_id, other in sorted(entry.items(), key=lambda kv: kv[1].rank):
            if other.rank <= top_n or other_id == token_id:
                top[token_text(other_id, other, decode, as_ids)] = clamp(other.logprob)
        result.top_logprobs.append(top)
    return result, offset + len(text)


class OpenAIServingCompletion(OpenAIServing):
    EMPTY_BODY = {"text": ""}

    async def create(self, req: CompletionRequest, raw_request: Request) -> Response:
        model_name = self.check_request(req)
        if req.prompt_embeds is not None:
            raise APIError("prompt_embeds is not supported by this server (prompts are text or token ids)", 400,
                           "prompt_embeds")
        if req.suffix:
            raise APIError("suffix is not currently supported", 400, "suffix")
        if req.max_tokens == 0 and not req.echo:
            raise APIError("max_tokens must be at least 1 (0 only with echo, which returns the prompt alone), got 0",
                           400, "max_tokens")
        echo_only = req.echo and req.max_tokens == 0
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:  # the echoed prompt's tokens carry logprobs too
            prompt_logprobs = _wider(prompt_logprobs, req.logprobs)
        params = sampling_params_of(req, 1 if echo_only else req.max_tokens, req.logprobs, self.generation_defaults,
                                    prompt_logprobs)
        await self.check_grammar(req, params)
        prompts = _prompt_list(req)
        self.limits.check_sequences(len(prompts), req.n)
        for prompt in prompts:
            if isinstance(prompt, str):
                self.limits.check_chars(len(prompt), "prompt")
        prompts = await self.offload.run(self._tokenize_texts, prompts, req.add_special_tokens)
        if req.truncate_prompt_tokens is not None:
            prompts = [self._truncated(req, prompt) for prompt in prompts]
        request_id = random_id("cmpl", req.request_id)
        ids = [f"{request_id}-{index}" for index in range(len(prompts))]
        stream = self._submit(req, ids, prompts, params)
        ctx = _CompletionContext(request_id, model_name, int(time.time()), req, self.shown_logprobs(req.logprobs),
                                 "text_completion",
                                 prompt_index={rid: index for index, rid in enumerate(ids)}, echo_only=echo_only)
        return await self.respond(ctx, stream, raw_request)

    def _submit(self, req: CompletionRequest, ids: list[str], prompts: list, params: SamplingParams) -> RequestStream:
        """All prompts into one stream; if one is rejected, those already added are aborted."""
        stream = None
        try:
            for request_id, prompt in zip(ids, prompts, strict=True):
                stream = self.add_request(req, request_id, prompt, params, stream)
        except BaseException:
            for request_id in stream.request_ids if stream is not None else []:
                self.engine.abort(request_id)
            raise
        return stream

    def _tokenize_texts(self, prompts: list, add_special_tokens: bool) -> list:
        """Text prompts as {"prompt_token_ids", "prompt"}; token-id prompts as they are. Runs in Offload."""
        out = []
        for prompt in prompts:
            if isinstance(prompt, str):
                if not prompt:
                    raise APIError("prompt must not be empty", 400, "prompt")
                prompt = {"prompt_token_ids": encode_ids(self.engine.tokenizer, prompt, add_special_tokens),
                          "prompt": prompt}
            out.append(prompt)
        return out

    def _truncated(self, req: CompletionRequest, prompt: list[int] | dict) -> dict:
        """The prompt as token ids cut by truncate_prompt_tokens (its text, if any, no longer matches)."""
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        kept = truncate_prompt(req, ids, self.model.max_model_len)
        return prompt if kept is ids and isinstance(prompt, dict) else {"prompt_token_ids": kept}

    # -- hooks of OpenAIServing ----------------------------------------------------------------------

    def new_choice(self) -> _CompletionChoice:
        return _CompletionChoice()

    def choice_index(self, ctx: _CompletionContext, request_output: RequestOutput,
                     completion: CompletionOutput) -> int:
        return ctx.prompt_index[request_output.request_id] * ctx.req.n + completion.index

    def delta_text(self, ctx: ResponseContext, choice: _CompletionChoice, request_output: RequestOutput,
                   completion: CompletionOutput) -> str:
        if ctx.req.echo and not choice.echoed:  # the prompt goes before the choice's first text
            choice.echoed = True
            prompt = request_output.prompt
            if prompt is None:
                prompt = self.engine.tokenizer.decode(request_output.prompt_token_ids)
            if ctx.top_logprobs is not None:  # the prompt's tokens, with their prompt logprobs, come first
                prompt_ids = request_output.prompt_token_ids
                prompt_lps = ctx.prompt_logprobs.get(request_output.request_id) or [None] * len(prompt_ids)
                choice.pending_ids[:0] = prompt_ids
                choice.pending_lps[:0] = prompt_lps
            return prompt + completion.text
        return completion.text

    def visible_completion(self, ctx: ResponseContext, completion: CompletionOutput) -> CompletionOutput:
        if not (isinstance(ctx, _CompletionContext) and ctx.echo_only):
            return completion
        return CompletionOutput(completion.index, "", [], "length" if completion.finished() else None,
                                logprobs=None if completion.logprobs is None else [])

    def delta_body(self, ctx: ResponseContext, choice: _CompletionChoice, text: str, final: bool) -> dict | None:
        return {"text": text} if text or final else None

    def logprobs_of(self, ctx: ResponseContext, choice: _CompletionChoice, token_ids: list[int],
                    entries: list[dict[int, Logprob] | None], text: str) -> CompletionLogprobs:
        logprobs, choice.text_offset = completion_logprobs(token_ids, entries, ctx.top_logprobs, choice.text_offset,
                                                           self.engine.tokenizer.decode, text,
                                                           bool(ctx.req.return_tokens_as_token_ids))
        return logprobs

    def keep_logprobs(self, choice: _CompletionChoice, logprobs: CompletionLogprobs) -> None:
        if choice.logprobs is None:
            choice.logprobs = CompletionLogprobs()
        for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
            getattr(choice.logprobs, name).extend(getattr(logprobs, name))

    def response(self, ctx: ResponseContext, choices: list[tuple[int, _CompletionChoice]],
                 usage_: dict) -> CompletionResponse:
        return CompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model_name,
            choices=[CompletionChoice(index=index, text=choice.text, logprobs=choice.logprobs,
                                      finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                                      prompt_logprobs=self._prompt_logprobs(ctx, choice),
                                      **self._token_ids(ctx, choice))
                     for index, choice in choices],
            usage=UsageInfo(**usage_),
        )

    def first_choice_fields(self, ctx: ResponseContext, request_id: str) -> dict:
        return {"prompt_token_ids": ctx.prompt_token_ids.get(request_id)}

    @staticmethod
    def _token_ids(ctx: ResponseContext, choice: _CompletionChoice) -> dict:
        if not ctx.req.return_token_ids:
            return {}
        return {"prompt_token_ids": ctx.prompt_token_ids.get(choice.request_id), "token_ids": choice.token_ids}

    @staticmethod
    def _prompt_logprobs(ctx: ResponseContext, choice: _CompletionChoice) -> list | None:
        if ctx.req.prompt_logprobs is None:
            return None
        return prompt_logprobs_json(ctx.prompt_logprobs.get(choice.request_id))


def _wider(a: int | None, b: int) -> int:
    """The larger top-N of two (-1, the whole vocabulary, is the largest)."""
    if a is None:
        return b
    return -1 if -1 in (a, b) else max(a, b)


def _prompt_list(req: CompletionRequest) -> list:
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt must not be empty", 400, "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)
