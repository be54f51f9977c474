"""Sampling parameters, validated on construction with messages that name the field and its range."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from stepahead.grammar_bounds import bounded_json_text, check_spec_chars
from stepahead.validation import InvalidInputError, check_field, shorten

logger = logging.getLogger(__name__)

# The engine's default cap on logprobs per token (EngineArgs.max_logprobs, --max-logprobs).
DEFAULT_MAX_LOGPROBS = 20
# OpenAI's range for a logit_bias value: -100 bans a token in practice, +100 forces it.
MAX_LOGIT_BIAS = 100.0
# Below this a temperature is greedy; up to _MIN_TEMPERATURE it is raised to that: dividing logits by a
# smaller one overflows to inf and the softmax to NaN (vLLM's two thresholds).
SAMPLING_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2
# A reasoning marker ("<think>", "</think>") is a few tokens at most.
_MAX_MARKER_TOKENS = 16


@dataclass
class StructuredOutputsParams:
    """A grammar constraint (vLLM's spellings); exactly one of the KINDS is set.

    json: a JSON schema (dict or its text; kept as text once its size and depth are checked, see
    grammar_bounds); regex: a regular expression the whole output matches; choice: the output is one
    of these strings; grammar: an EBNF/GBNF grammar whose rule `root` the output matches;
    json_object: any JSON object; structural_tag: an xgrammar structural tag, as JSON text (or a dict),
    in vLLM's legacy form {"structures": [{"begin", "schema", "end"}], "triggers": [...]} or xgrammar's
    {"type": "structural_tag", "format": {...}} (see structured_output/structural_tag.py).

    With json or json_object: disable_any_whitespace compiles compact JSON (no whitespace between
    tokens); whitespace_pattern is refused by name (xgrammar has no whitespace pattern).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    # With a reasoning model (the server's --reasoning-parser sets them): the grammar constrains only what
    # follows the end-of-reasoning marker, these token ids; None: it constrains the output from its first
    # token. reasoning_start_token_ids: the output is reasoning only if it opens with these (qwen3); None:
    # it begins in reasoning (deepseek_r1). See structured_output/reasoning_gate.py.
    reasoning_end_token_ids: list[int] | None = None
    reasoning_start_token_ids: list[int] | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
    JSON_KINDS = ("json", "json_object")  # the kinds the whitespace options apply to

    def __post_init__(self) -> None:
        given = [name for name in self.KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidInputError(
                f"structured_outputs: exactly one of {', '.join(self.KINDS)} must be set (got {given})",
                param="structured_outputs",
            )
        if self.choice is not None and not (self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidInputError(
                "structured_outputs: choice must be a non-empty list of non-empty strings, got "
                f"{shorten(repr(self.choice))}",
                param="structured_outputs",
            )
        if self.json is not None:
            self.json = bounded_json_text(self.json, "JSON schema")
        if self.structural_tag is not None:
            self.structural_tag = bounded_json_text(self.structural_tag, "structural tag")
        for what, text in (("regex", self.regex), ("grammar", self.grammar)):
            if text is not None:
                check_spec_chars(len(text), what)
        if self.choice is not None:
            check_spec_chars(sum(len(c) for c in self.choice), "choice list")
        self._check_whitespace_options(given[0])
        for name in ("reasoning_end_token_ids", "reasoning_start_token_ids"):
            ids = getattr(self, name)
            if ids is not None and not (isinstance(ids, list) and ids and len(ids) <= _MAX_MARKER_TOKENS and all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
                raise InvalidInputError(f"structured_outputs: {name} must be a list of 1 to {_MAX_MARKER_TOKENS} "
                                        f"token ids, got {shorten(repr(ids))}", param="structured_outputs")
        if self.reasoning_start_token_ids is not None and self.reasoning_end_token_ids is None:
            raise InvalidInputError("structured_outputs: reasoning_start_token_ids needs reasoning_end_token_ids",
                                    param="structured_outputs")

    def _check_whitespace_options(self, kind: str) -> None:
        """Both shape JSON's whitespace: refused with any other constraint rather than ignored."""
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidInputError("structured_outputs: disable_any_whitespace must be true or false, got "
                                    f"{shorten(repr(self.disable_any_whitespace))}", param="structured_outputs")
        for name in ("disable_any_whitespace", "whitespace_pattern"):
            if getattr(self, name) not in (None, False) and kind not in self.JSON_KINDS:
                raise InvalidInputError(f"structured_outputs: {name} applies to json and json_object only, not to "
                                        f"{kind}", param="structured_outputs")
        if self.whitespace_pattern is not None:
            # xgrammar (the backend) compiles JSON with any whitespace or none: it has no pattern for it.
            raise InvalidInputError("structured_outputs: whitespace_pattern is not supported by the xgrammar "
                                    "backend; disable_any_whitespace gives compact JSON", param="structured_outputs")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of KINDS."""
        return next(name for name in self.KINDS if getattr(self, name) not in (None, False))


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: the rest of the context
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # top-N logprobs per sampled token (the sampled token is always included); -1: the whole vocabulary.
    # The engine caps N at its max_logprobs.
    logprobs: int | None = None
    # top-N logprobs per prompt token after the first (the prompt token is always included); such a
    # request reads nothing from the prefix cache, so every position it asks about is computed.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # With skip_special_tokens False: False joins a special (added) token directly after another to it,
    # without the space the tokenizer's decoder may put between them (vLLM's).
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before penalties and sampling
    allowed_token_ids: list[int] | None = None  # sample only among these (and their logprobs are over them)
    # Words never to complete (vLLM's bad_words): a word's last token is banned wherever the output ends
    # with the rest of it. The engine fills bad_words_token_ids from the tokenizer (each word alone and
    # after a space); they are what the sampler reads.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        check_field(self.n >= 1, "n", self.n, "must be >= 1")
        check_field(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        elif self.temperature < _MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s, where logits overflow; using %s",
                           self.temperature, _MIN_TEMPERATURE, _MIN_TEMPERATURE)
            self.temperature = _MIN_TEMPERATURE
        check_field(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        check_field(self.top_k >= 0, "top_k", self.top_k, "must be -1 (off), 0 (off) or a positive integer")
        check_field(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        check_field(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        check_field(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        check_field(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check_field(value is None or value >= -1, name, value, "must be -1 (the whole vocabulary) or >= 0")
        check_field(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        check_field(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        check_field(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", self.repetition_penalty, "must be in (0, 2]")
        check_field(all(self.stop), "stop", self.stop, "must not contain empty strings")
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
            check_field(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words", self.bad_words,
                        "must be non-empty strings")
        check_field(all(token_id >= 0 for token_id in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
                    "must be >= 0")
        self._check_logit_bias()
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            check_field(bool(self.allowed_token_ids), "allowed_token_ids", self.allowed_token_ids,
                        "must not be empty")
            check_field(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids),
                        "allowed_token_ids", self.allowed_token_ids, "must be token ids (integers >= 0)")

    def _check_logit_bias(self) -> None:
        """Keys become ints (JSON gives strings); values must be finite and in OpenAI's range."""
        if not self.logit_bias:
            self.logit_bias = None
            return
        bias, bad_keys = {}, []
        for key, value in self.logit_bias.items():
            try:
                token_id = int(key)
            except (TypeError, ValueError):
                bad_keys.append(key)
                continue
            if isinstance(key, bool) or token_id < 0 or (isinstance(key, float) and key != token_id):
                bad_keys.append(key)
                continue
            bias[token_id] = value
        check_field(not bad_keys, "logit_bias", bad_keys[:8], "keys must be token ids (integers >= 0)")
        bad_values = [v for v in bias.values()
                      if isinstance(v, bool) or not isinstance(v, int | float) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS]
        check_field(not bad_values, "logit_bias", bad_values[:8],
                    f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        self.logit_bias = {token_id: float(value) for token_id, value in bias.items()}

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reads_output_history(self) -> bool:
        """Sampling needs every earlier output id: penalties count them, bad words match their ends."""
        return self.uses_penalties or bool(self.bad_words_token_ids)

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate_token_ids(self, vocab_size: int) -> None:
        """Token ids in the parameters must exist in the model's vocabulary."""
        checked: tuple[tuple[str, Iterable[int]], ...] = (
            ("stop_token_ids", self.stop_token_ids or ()), ("logit_bias", self.logit_bias or ()),
            ("allowed_token_ids", self.allowed_token_ids or ()))
        grammar = self.structured_outputs
        if grammar is not None:  # the gate's markers index the grammar's bitmask
            checked += (("structured_outputs", [*(grammar.reasoning_end_token_ids or ()),
                                                *(grammar.reasoning_start_token_ids or ())]),)
        for name, ids in checked:
            out_of_vocab = [token_id for token_id in ids if token_id >= vocab_size][:8]
            check_field(not out_of_vocab, name, out_of_vocab, f"must be token ids in [0, {vocab_size})")
