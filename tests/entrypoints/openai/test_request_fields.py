"""No request field is accepted and then ignored.

Every field a request model declares (nested models included) must be read by the server's code or be
on a list that refuses it by name when set; and every field of vLLM's own completion and chat requests
must be declared, since the models accept undeclared fields (OpenAI clients send new ones) and would
otherwise ignore them. A field added to a model and never read fails here; so does a vLLM field nobody
declared.
"""

from __future__ import annotations

import ast
import functools
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

import stepahead
from stepahead.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from stepahead.entrypoints.openai.responses_protocol import ResponsesRequest
from stepahead.entrypoints.openai.serving_utils import UNIMPLEMENTED_FIELDS

PACKAGE = Path(stepahead.__file__).parent
DECLARING = {"protocol.py", "responses_protocol.py"}
REQUESTS = (CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest)

# Fields that change nothing the server computes, by design: OpenAI's end-user id and metadata.
NO_EFFECT = {"user", "metadata"}

# The fields of vLLM's CompletionRequest and ChatCompletionRequest (vllm/entrypoints/openai/protocol.py).
VLLM_COMMON = {
    "model", "frequency_penalty", "logit_bias", "max_tokens", "n", "presence_penalty", "response_format", "seed",
    "stop", "stream", "stream_options", "temperature", "top_p", "user", "best_of", "use_beam_search", "top_k",
    "min_p", "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "allowed_token_ids", "prompt_logprobs", "bad_words", "add_special_tokens", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs",
    "priority", "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "thinking_token_budget",
}
VLLM_COMPLETION = VLLM_COMMON | {"prompt", "echo", "logprobs", "suffix", "prompt_embeds", "truncation_side"}
VLLM_CHAT = VLLM_COMMON | {
    "messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "reasoning_effort",
    "include_reasoning", "parallel_tool_calls", "echo", "add_generation_prompt", "continue_final_message",
    "documents", "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "prediction",
}


@functools.cache
def _read_names() -> set[str]:
    """Attribute names read, and string constants (getattr's names, refusal tables), outside the models."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name in DECLARING:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
    return names


def _models(model: type[BaseModel], seen: set[type[BaseModel]]) -> None:
    """model and every request model its fields hold."""
    if model in seen:
        return
    seen.add(model)
    for info in model.model_fields.values():
        stack = [info.annotation]
        while stack:
            hint = stack.pop()
            if isinstance(hint, type) and issubclass(hint, BaseModel):
                _models(hint, seen)
            elif isinstance(hint, types.UnionType) or typing.get_origin(hint) is not None:
                stack.extend(typing.get_args(hint))


def _declared() -> list[tuple[str, str]]:
    seen: set[type[BaseModel]] = set()
    for request in REQUESTS:
        _models(request, seen)
    return sorted((model.__name__, name) for model in seen for name in model.model_fields)


@pytest.mark.parametrize(("model", "name"), _declared())
def test_every_declared_field_is_read_or_refused(model, name):
    assert name in _read_names() or name in UNIMPLEMENTED_FIELDS or name in NO_EFFECT, \
        f"{model}.{name} is declared but nothing reads it: honour it, or refuse it in UNIMPLEMENTED_FIELDS"


@pytest.mark.parametrize(("model", "fields"), [(CompletionRequest, VLLM_COMPLETION), (ChatCompletionRequest, VLLM_CHAT)])
def test_every_vllm_field_is_declared(model, fields):
    assert sorted(fields - set(model.model_fields)) == []
