"""Keeping one request from stalling, starving or exhausting the server.

- `Offload`: CPU work that grows with the input (tokenizing, rendering chat templates) runs on worker
  threads, at most `max_queued` at a time (later ones wait), so the event loop only parses, validates
  cheaply and streams: /health and other requests keep answering while a large prompt is tokenized.
- `RequestLimits`: cheap checks before any of that work: prompt characters (a prompt needs far fewer
  than MAX_CHARS_PER_TOKEN characters per token of context), sequences per request (prompts × n); and
  the time a grammar may take to parse (on an Offload thread).
- `BodySizeLimit`: an ASGI middleware answering 413 to a body over the limit, before it is read whole.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stepahead.entrypoints.openai.errors import APIError, error_body

T = TypeVar("T")
# No tokenizer in use spends anywhere near this many characters on one token: a longer prompt cannot
# fit the context, so it is refused before tokenizing it.
MAX_CHARS_PER_TOKEN = 64
DEFAULT_MAX_REQUEST_BYTES = 16 << 20
MAX_N = 128  # choices per prompt; each is a full engine request


def default_max_sequences(max_num_seqs: int) -> int:
    return max(MAX_N, 4 * max_num_seqs)


class Offload:
    def __init__(self, workers: int = 2, max_queued: int = 64) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="stepahead-offload")
        self._max_queued = max_queued
        self._slots: asyncio.Semaphore | None = None  # made on the event loop that uses it

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_queued)
        async with self._slots:
            return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    max_sequences: int  # prompts × n in one request
    trust_request_chat_template: bool = False
    # A grammar within grammar_bounds' size and depth parses in well under a second; this is a backstop.
    grammar_parse_timeout_s: float = 10.0

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * MAX_CHARS_PER_TOKEN

    def check_chars(self, num_chars: int, param: str, what: str = "the prompt has") -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(f"{what} {num_chars} characters, more than a context of {self.max_model_len} "
                           f"tokens can hold (at most {self.max_prompt_chars})", 400, param)

    def check_tokens(self, num_tokens: int, param: str) -> None:
        if num_tokens > self.max_model_len:
            raise APIError(f"the prompt has {num_tokens} tokens, more than the context length {self.max_model_len}",
                           400, param)

    def check_sequences(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_sequences:
            raise APIError(f"this request asks for {num_prompts} prompt(s) × n={n} = {num_prompts * n} sequences; at "
                           f"most {self.max_sequences} per request", 400, "n")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        received = 0

        async def counting_receive() -> Message:
            # A body without a (truthful) length: stop reading it at the limit; the app's HTTPException
            # handler answers 413.
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self._message())
            return message

        await self.app(scope, counting_receive, send)

    def _message(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes"

    async def _reject(self, send: Send) -> None:
        import json

        body = json.dumps(error_body(self._message(), 413)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
