"""Chat templates that requests bring (allowed only with --trust-request-chat-template) render in a
child process with a time and an output-size limit.

A template is code: transformers renders it in Jinja's sandbox, which stops attribute tricks but not
`{% for i in range(100000) %}{% for j in range(100000) %}`, which would hold a thread for hours. In a
child process a render past its time limit is ended by terminating the process; the next render
starts a fresh one (loading the tokenizer there takes a second or two, once).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import threading
from typing import Any

from stepahead.config import ModelConfig
from stepahead.entrypoints.openai.errors import APIError

TIME_LIMIT_S = 2.0
MAX_OUTPUT_CHARS = 1 << 20

_tokenizer: Any = None  # the child's


def _load(model_config: ModelConfig) -> None:
    global _tokenizer
    from stepahead.models.loading.loader import load_tokenizer

    _tokenizer = load_tokenizer(model_config)


def _ready() -> bool:
    return True


def _render(conversation: list[dict], template: str, kwargs: dict[str, Any], max_chars: int) -> str | Exception:
    try:
        text = _tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False, **kwargs)
    except Exception as e:  # the template's error goes back as the 400's message
        return ValueError(f"the chat template could not render these messages: {e}")
    if len(text) > max_chars:
        return ValueError(f"the chat template rendered {len(text)} characters, more than {max_chars}")
    return text


class TemplateSandbox:
    def __init__(self, model_config: ModelConfig, time_limit_s: float = TIME_LIMIT_S,
                 max_chars: int = MAX_OUTPUT_CHARS) -> None:
        self._model_config = model_config
        self._time_limit_s = time_limit_s
        self._max_chars = max_chars
        self._lock = threading.Lock()  # one render at a time: the child has one worker
        self._pool: multiprocessing.pool.Pool | None = None

    def render(self, conversation: list[dict], template: str, kwargs: dict[str, Any]) -> str:
        """Blocking (call it through Offload); a 400 when the template fails, runs too long or renders too much."""
        with self._lock:
            if self._pool is None:
                self._pool = multiprocessing.get_context("spawn").Pool(1, _load, (self._model_config,))
                self._pool.apply(_ready)  # started, tokenizer loaded: the time limit is the render's alone
            pending = self._pool.apply_async(_render, (conversation, template, kwargs, self._max_chars))
            try:
                result = pending.get(self._time_limit_s)
            except multiprocessing.TimeoutError:
                self._pool.terminate()
                self._pool = None
                raise APIError(f"the chat template did not finish rendering within {self._time_limit_s:.0f} s",
                               400, "chat_template") from None
        if isinstance(result, Exception):
            raise APIError(str(result), 400, "chat_template")
        return result

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.terminate()
                self._pool = None
