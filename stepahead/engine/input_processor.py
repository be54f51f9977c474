"""Prompts -> validated engine Requests. Everything is checked before anything runs.

Shared by the offline LLM and the API server, so both reject bad input with the same messages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from stepahead.config import ModelConfig
from stepahead.request import Request
from stepahead.sampling_params import SamplingParams

# A prompt is text, token ids, or {"prompt_token_ids": [...]} (optionally with "prompt": its text).
PromptType = str | list[int] | dict[str, Any]

_SEED_STRIDE = 0x9E3779B1  # odd 32-bit constant: children's seeds stay distinct and far apart


def child_request_id(index: int, request_id: str) -> str:
    return f"{index}_{request_id}"


def child_seed(seed: int, index: int) -> int:
    """Child 0 keeps the user's seed (n=1 is unaffected); the others get distinct derived seeds."""
    return (seed + index * _SEED_STRIDE) % (1 << 63)


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_model_len
        # The embedding table may be padded past the tokenizer; any id the model can embed is valid.
        self.vocab_size = model_config.vocab_size

    def tokenize(self, prompt: PromptType) -> tuple[list[int], str | None]:
        """Token ids and text of a prompt (text is None when only ids were given)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return list(self.tokenizer.encode(prompt)), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"prompt dict must have 'prompt_token_ids', got keys {sorted(prompt)}")
            ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
        elif isinstance(prompt, (list, tuple)):
            ids, text = prompt, None
        else:
            raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        return list(ids), text

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> tuple[list[Request], str | None]:
        """The n engine Requests of one prompt, and the prompt's text (None for token-id prompts)."""
        prompt_ids, text = self.tokenize(prompt)
        self.validate(prompt_ids, params)
        reqs = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else child_seed(params.seed, i)
                child_params = dataclasses.replace(params, n=1, seed=seed)
            reqs.append(Request(
                child_request_id(i, request_id),
                prompt_ids,
                child_params,
                eos_token_id=self.model_config.eos_token_id,
                arrival_time=arrival_time,
                max_model_len=self.max_model_len,
            ))
        return reqs, text

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids must be token ids in [0, {self.vocab_size}), got {bad[:8]}"
                + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
            )
        params.validate_token_ids(self.vocab_size)
        n_prompt = len(prompt_ids)
        n_completion = params.max_tokens or 0
        if n_prompt + n_completion > self.max_model_len or n_prompt >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n_prompt + n_completion} tokens ({n_prompt} in the messages, {n_completion} in the completion). "
                "Please reduce the length of the messages or completion."
            )
