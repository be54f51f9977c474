"""What the completions and chat handlers share: model names, request -> SamplingParams, SSE, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, cast

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from stepahead.entrypoints.openai.errors import APIError, error_body, error_from_exception
from stepahead.entrypoints.openai.protocol import ResponseFormat, SamplingFields
from stepahead.entrypoints.openai.request_limits import MAX_N
from stepahead.outputs import LOGPROB_FLOOR, Logprob
from stepahead.sampling_params import SamplingParams, StructuredOutputsParams
from stepahead.validation import InvalidInputError, shorten

logger = logging.getLogger("stepahead.entrypoints.openai")


MAX_LOGGED_FIELD_NAMES = 64
MAX_FIELD_NAME_CHARS = 64


@dataclass
class ServedModel:
    names: list[str]
    root: str
    max_model_len: int
    _logged_ignored: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.names[0]

    def check(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if requested is None or requested == "":
            return self.name
        if requested not in self.names:
            raise APIError(f"The model `{shorten(requested)}` does not exist.", 404, "model")
        return requested

    def log_ignored_fields(self, req: Any) -> None:
        """Unknown request fields are accepted; say so once per field name, for the first
        MAX_LOGGED_FIELD_NAMES names (cut to MAX_FIELD_NAME_CHARS): a client sending endless new names
        must not grow the server's memory or its log."""
        extra = getattr(req, "model_extra", None) or {}
        room = MAX_LOGGED_FIELD_NAMES - len(self._logged_ignored)
        if not extra or room <= 0:
            return
        new = sorted({name[:MAX_FIELD_NAME_CHARS] for name in extra} - self._logged_ignored)[:room]
        if new:
            self._logged_ignored.update(new)
            full = " (no more ignored field names will be logged)" if len(self._logged_ignored) >= \
                MAX_LOGGED_FIELD_NAMES else ""
            logger.warning("The following fields were present in the request but ignored: %s%s", new, full)


# Fields that would change the output but that the engine does not implement, and why: set to anything
# but their default, each is a 400 naming it, never a silent ignore.
UNIMPLEMENTED_FIELDS = {
    "use_beam_search": "beam search is not implemented",
    "length_penalty": "it weighs beam search's candidates, and beam search is not implemented",
    "logits_processors": "logits processors named by requests are not implemented",
    "thinking_token_budget": "a budget of reasoning tokens is not implemented",
    "prediction": "predicted outputs are not implemented",
    "guided_decoding_backend": "the server's --structured-outputs-backend compiles every grammar",
    "mm_processor_kwargs": "requests carry text and token ids only",
    "kv_transfer_params": "KV transfer between servers is not implemented",
    "vllm_xargs": "no custom extension reads them",
}


def reject_unsupported(req: SamplingFields) -> None:
    """Fields that would change the output but are not implemented: a 400, never a silent ignore."""
    for name, why in UNIMPLEMENTED_FIELDS.items():
        if getattr(req, name) != type(req).model_fields[name].default:
            raise APIError(f"{name} is not supported by this server: {why}", 400, name)
    if req.prompt_logprobs is not None and req.stream:
        raise APIError("`prompt_logprobs` are not available when `stream=True`.", 400, "prompt_logprobs")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(f"best_of must equal n ({req.n}) (best-of sampling is not supported), got {req.best_of}",
                       400, "best_of")
    if not 1 <= req.n <= MAX_N:
        raise APIError(f"n must be in [1, {MAX_N}], got {req.n}", 400, "n")
    if req.stream_options is not None and not req.stream:
        raise APIError("Stream options can only be defined when `stream=True`.", 400, "stream_options")


def grammar_param(req: SamplingFields) -> str:
    """The field a client set its grammar with: OpenAI's response_format, vLLM's top-level structural_tag,
    or vLLM's structured_outputs (and the guided_* fields)."""
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    if req.structural_tag is not None:
        return "structural_tag"
    return "structured_outputs"


def _structural_tag_of(response_format: ResponseFormat) -> dict[str, Any]:
    """A structural_tag response_format as the structural tag it holds (structural_tag.py's two forms)."""
    legacy = response_format.structures is not None or response_format.triggers is not None
    if legacy == (response_format.format is not None):
        raise APIError("response_format of type structural_tag needs either structures and triggers (vLLM's "
                       "form) or format (xgrammar's form)", 400, "response_format")
    if not legacy:
        return {"type": "structural_tag", "format": response_format.format}
    if response_format.structures is None or response_format.triggers is None:
        raise APIError("response_format of type structural_tag needs both structures and triggers", 400,
                       "response_format")
    structures = [{"begin": s.begin, "schema": s.json_schema, "end": s.end} for s in response_format.structures]
    return {"structures": structures, "triggers": response_format.triggers}


def _response_format_constraint(response_format: ResponseFormat) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.type == "structural_tag":
        return StructuredOutputsParams(structural_tag=_structural_tag_of(response_format))
    schema = (response_format.json_schema or {}).get("schema")
    if schema is None:
        raise APIError("response_format.json_schema.schema is required", 400, "response_format")
    return StructuredOutputsParams(json=schema)


def structured_outputs_of(req: SamplingFields) -> StructuredOutputsParams | None:
    """The grammar constraint of response_format, structured_outputs, or vLLM's older top-level fields
    (guided_*, structural_tag); whether the engine takes it is the input processor's check, shared
    with the offline LLM."""
    if req.guided_whitespace_pattern is not None:  # vLLM's older spelling of whitespace_pattern, refused alike
        raise APIError("guided_whitespace_pattern is not supported by the xgrammar backend (it has no whitespace "
                       "pattern); structured_outputs.disable_any_whitespace gives compact JSON", 400,
                       "guided_whitespace_pattern")
    structured = req.structured_outputs
    older = {name: value for name, field_name in (("json", "guided_json"), ("regex", "guided_regex"),
                                                  ("choice", "guided_choice"), ("grammar", "guided_grammar"),
                                                  ("structural_tag", "structural_tag"))
             if (value := getattr(req, field_name)) is not None}
    response_format = req.response_format
    asked = [name for name, given in (("response_format", response_format is not None and response_format.type != "text"),
                                      ("structured_outputs", structured is not None),
                                      ("guided_*/structural_tag", bool(older))) if given]
    if len(asked) > 1:
        raise APIError(f"Only one of response_format, structured_outputs and guided_* (or structural_tag) may be "
                       f"set, got {asked}", 400, "structured_outputs")
    try:
        if asked == ["response_format"] and response_format is not None:
            return _response_format_constraint(response_format)
        if older:
            return StructuredOutputsParams(**older)
        if structured is None:
            return None
        return StructuredOutputsParams(
            json=structured.json_schema, regex=structured.regex, choice=structured.choice,
            grammar=structured.grammar, json_object=structured.json_object, structural_tag=structured.structural_tag,
            disable_any_whitespace=structured.disable_any_whitespace, whitespace_pattern=structured.whitespace_pattern)
    except InvalidInputError as e:
        e.param = grammar_param(req)  # the field the client asked through
        raise


def sampling_params_of(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                       defaults: dict[str, Any], prompt_logprobs: int | None = None) -> SamplingParams:
    """Raises ValueError (a 400) naming the field and its range. Fields the request leaves unset take
    `defaults` (the model's generation_config.json), then vLLM's own defaults."""
    def pick(value: Any, name: str, fallback: Any) -> Any:
        return defaults.get(name, fallback) if value is None else value

    if max_tokens is not None and defaults.get("max_tokens") is not None:
        max_tokens = min(max_tokens, defaults["max_tokens"])  # the model's cap holds, as in vLLM

    return SamplingParams(
        n=req.n,
        temperature=pick(req.temperature, "temperature", 1.0),
        top_p=pick(req.top_p, "top_p", 1.0),
        top_k=pick(req.top_k, "top_k", 0),
        min_p=pick(req.min_p, "min_p", 0.0),
        seed=req.seed,
        max_tokens=pick(max_tokens, "max_tokens", None),
        min_tokens=req.min_tokens,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        structured_outputs=structured_outputs_of(req),
        # SamplingParams makes the keys ints (refusing any that is not); the engine checks the ids.
        logit_bias=cast(dict[int, float] | None, req.logit_bias),
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def check_finish(finish_reason: str | None, stop_reason: Any) -> None:
    """A choice the engine could not finish normally fails the whole response with a 500."""
    if finish_reason == "error":
        raise APIError(f"The engine failed this request: {stop_reason or 'internal error'}", 500)
    if finish_reason == "abort":
        raise APIError("The request was aborted (the server is shutting down)", 500)


def clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or token id -> logprob, rank, decoded token."""
    if entries is None:
        return None
    return [None if entry is None else
            {str(token_id): {"logprob": clamp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token_id, lp in entry.items()}
            for entry in entries]


def token_text(token_id: int, logprob: Logprob | None, decode, as_id: bool = False) -> str:
    """A token's text: the detokenizer's when it has one, else decoded alone; as_id: vLLM's
    return_tokens_as_token_ids form "token_id:N" (tokens that are not whole characters stay exact)."""
    if as_id:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode([token_id])


# -- server-sent events ---------------------------------------------------------------------------


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(e: BaseException) -> str:
    err = error_from_exception(e)
    if err.status >= 500 and err.status != 503:  # a shutdown cutting streams is logged once, by the server
        logger.error("Streaming request failed: %s", err.message)
    return sse(error_body(err.message, err.status, err.param))


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator.

    When the client disconnects, Starlette cancels the response while the generator may be parked
    at a `yield`; closing it runs the handler's cleanup (the engine abort) now, not at some later
    garbage collection.
    """

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def with_cancellation(raw_request: Request, work: Awaitable[Any]) -> Any:
    """Run a non-streaming handler, cancelling it (and so aborting its requests) if the client leaves.

    Listens on receive() for http.disconnect rather than polling is_disconnected(), which does not
    see disconnects behind middleware.
    """
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        listener.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise APIError("Client disconnected", 499)


async def _wait_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


def truncate_prompt(req: SamplingFields, prompt_ids: list[int], max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt cut to that many tokens (-1: the context length), its
    start dropped (truncation_side "left", the default) or its end ("right")."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return prompt_ids
    if keep > max_model_len:
        raise APIError(f"truncate_prompt_tokens must be at most the context length {max_model_len}, got {keep}",
                       400, "truncate_prompt_tokens")
    keep = max_model_len if keep == -1 else keep
    if len(prompt_ids) <= keep:
        return prompt_ids
    return prompt_ids[:keep] if req.truncation_side == "right" else prompt_ids[len(prompt_ids) - keep:]


def encode_ids(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of text. CPU work that grows with the input: call it through Offload."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(f"the text is not valid Unicode (a lone surrogate at character {e.start})", 400,
                       "prompt") from None
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
