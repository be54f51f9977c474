"""Prompts -> validated engine Requests. Everything is checked before anything runs.

Shared by the offline LLM and the API server, so both reject bad input with the same messages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from stepahead.config import ModelConfig
from stepahead.request import Request, check_context_length
from stepahead.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams
from stepahead.structured_output import validate_structured_outputs
from stepahead.validation import InvalidInputError, check_field

# A prompt is text, token ids, or {"prompt_token_ids": [...]} (optionally with "prompt": its text).
PromptType = str | list[int] | dict[str, Any]

_SEED_STRIDE = 0x9E3779B1  # odd 32-bit constant: children's seeds stay distinct and far apart


def child_request_id(index: int, request_id: str) -> str:
    return f"{index}_{request_id}"


def child_seed(seed: int, index: int) -> int:
    """Child 0 keeps the user's seed (n=1 is unaffected); the others get distinct derived seeds."""
    return (seed + index * _SEED_STRIDE) % (1 << 63)


def check_structured_outputs(params: SamplingParams, backend: str) -> None:
    """A request's grammar must be one the backend compiles; with no backend it is refused, never
    silently ignored. The one check for the offline LLM and the API server (a 400 there)."""
    if params.structured_outputs is None:
        return
    if backend == "none":
        raise InvalidInputError(
            "structured outputs are disabled on this engine (--structured-outputs-backend none); remove "
            "structured_outputs (on the server also response_format json_object/json_schema)",
            param="structured_outputs",
        )
    validate_structured_outputs(params.structured_outputs)


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any, structured_outputs_backend: str = "xgrammar",
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, scheduling_policy: str = "fcfs") -> None:
        self.model_config = model_config
        self.scheduling_policy = scheduling_policy
        self.max_logprobs = max_logprobs  # -1: no limit
        self.structured_outputs_backend = structured_outputs_backend
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_model_len
        # The embedding table may be padded past the tokenizer; any id the model can embed is valid.
        self.vocab_size = model_config.vocab_size

    def check_structured_outputs(self, params: SamplingParams) -> None:
        check_structured_outputs(params, self.structured_outputs_backend)

    def tokenize(self, prompt: PromptType) -> tuple[list[int], str | None]:
        """Token ids and text of a prompt (text is None when only ids were given)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("prompt must not be empty", param="prompt")
            return list(self.tokenizer.encode(prompt)), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise InvalidInputError(f"prompt dict must have 'prompt_token_ids', got keys {sorted(prompt)}",
                                        param="prompt_token_ids")
            ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
        elif isinstance(prompt, (list, tuple)):
            ids, text = prompt, None
        else:
            raise InvalidInputError(
                f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}", param="prompt")
        if not all(isinstance(token_id, int) and not isinstance(token_id, bool) for token_id in ids):
            raise InvalidInputError("prompt_token_ids must be a list of integers", param="prompt_token_ids")
        return list(ids), text

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> tuple[list[Request], str | None]:
        """The n engine Requests of one prompt, and the prompt's text (None for token-id prompts)."""
        self.check_priority(priority)
        prompt_ids, text = self.tokenize(prompt)
        if params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        self.validate(prompt_ids, params)
        children = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else child_seed(params.seed, index)
                child_params = dataclasses.replace(params, n=1, seed=seed)
            children.append(Request(
                child_request_id(index, request_id),
                prompt_ids,
                child_params,
                eos_token_id=self.model_config.eos_token_id,
                extra_eos_token_ids=self.model_config.extra_eos_token_ids,
                arrival_time=arrival_time,
                max_model_len=self.max_model_len,
                priority=priority,
                cache_salt=cache_salt,
            ))
        return children, text

    def check_priority(self, priority: int) -> None:
        """A priority other than 0 needs the priority scheduling policy (as vLLM): never accepted and ignored."""
        check_field(isinstance(priority, int) and not isinstance(priority, bool), "priority", priority,
                    "must be an integer")
        check_field(priority == 0 or self.scheduling_policy == "priority", "priority", priority,
                    "needs the priority scheduling policy (--scheduling-policy priority); this engine schedules "
                    f"{self.scheduling_policy}, where only 0 is allowed")

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's token ids alone and after a space (where that is another token sequence of the
        same length, vLLM's rule: the word as it appears mid-text)."""
        encode = self.tokenizer.encode
        out: list[list[int]] = []
        for word in words:
            alone = list(encode(word.lstrip(), add_special_tokens=False))
            spaced = list(encode(" " + word.lstrip(), add_special_tokens=False))
            out.append(alone)
            if len(spaced) == len(alone) and spaced[0] != alone[0]:
                out.append(spaced)
        return [ids for ids in out if ids]

    def _check_num_logprobs(self, params: SamplingParams) -> None:
        """At most max_logprobs per token (-1 asks for the whole vocabulary)."""
        limit = self.max_logprobs
        for name, asked in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if asked is None or limit == -1:
                continue
            wanted = self.vocab_size if asked == -1 else asked
            whole = f"; -1 asks for the whole vocabulary, {self.vocab_size} tokens" if asked == -1 else ""
            check_field(wanted <= limit, name, asked, f"must be at most {limit}, the engine's max_logprobs{whole}")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.check_structured_outputs(params)
        if not prompt_ids:
            raise InvalidInputError("prompt must not be empty (it has 0 tokens)", param="prompt")
        out_of_vocab = [token_id for token_id in prompt_ids if not 0 <= token_id < self.vocab_size]
        if out_of_vocab:
            raise InvalidInputError(
                f"prompt_token_ids must be token ids in [0, {self.vocab_size}); out of vocabulary: {out_of_vocab[:8]}"
                + (f" and {len(out_of_vocab) - 8} more" if len(out_of_vocab) > 8 else ""),
                param="prompt_token_ids",
            )
        params.validate_token_ids(self.vocab_size)
        self._check_num_logprobs(params)
        # max_tokens None means "the rest of the context", which still needs room for one token.
        check_context_length(len(prompt_ids), self.max_model_len, params.max_tokens or 1)
