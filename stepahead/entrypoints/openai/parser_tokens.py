"""The --reasoning-parser and --tool-call-parser markers as the model's tokenizer writes them: checked when
the server starts (before the model loads), and what serving then needs of them.

Refused, with the missing markers named:
- a reasoning parser whose start or end marker the tokenizer cannot encode as one token: the engine's
  reasoning gate (a grammar waits for the reasoning to end) watches for the marker's token, and a marker
  spelled in several tokens may be written in other pieces, so a grammar would wait for ever;
- a tool-call parser whose format's own tokens (ToolStream.REQUIRED_TOKENS: mistral's `[TOOL_CALLS]`,
  qwen3_coder's `<tool_call>`) the tokenizer lacks (vLLM's check: such a model is not of that family).
  Formats read as text (hermes, pythonic, phi4_mini_json, llama3_json) need no token.

A marker the tokenizer makes a special token would vanish from the output text (special tokens are
skipped when decoding), so the requests its parser reads keep special tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stepahead.engine.output_processor import fast_decoder
from stepahead.entrypoints.openai.reasoning import REASONING_PARSERS
from stepahead.entrypoints.openai.tool_calling.parsers import TOOL_PARSERS


@dataclass(frozen=True)
class ParserTokens:
    reasoning_end: list[int] | None = None  # the reasoning gate's end marker (None: no reasoning parser)
    reasoning_start: list[int] | None = None  # the start marker where the output must open with it to reason
    reasoning_keeps_special: bool = False  # a reasoning marker is a special token: decode keeping them
    tools_keep_special: bool = False  # likewise for a marker of the tool-call parser ("auto" requests)


def parser_tokens(tokenizer: Any, tool_parser: str | None, reasoning_parser: str | None) -> ParserTokens:
    """Raises ValueError naming the parser and the markers the tokenizer lacks as single tokens."""
    decode = fast_decoder(tokenizer)
    tokens = ParserTokens()
    if tool_parser is not None:
        stream = TOOL_PARSERS[tool_parser]
        _require(tokenizer, stream.REQUIRED_TOKENS, f"--tool-call-parser {tool_parser}")
        tokens = ParserTokens(tools_keep_special=_any_dropped(tokenizer, decode, stream.MARKERS))
    if reasoning_parser is None:
        return tokens
    parser = REASONING_PARSERS[reasoning_parser]
    start, end = _require(tokenizer, (parser.start, parser.end), f"--reasoning-parser {reasoning_parser}")
    return ParserTokens(reasoning_end=[end], reasoning_start=None if parser.in_reasoning else [start],
                        reasoning_keeps_special=_any_dropped(tokenizer, decode, (parser.start, parser.end)),
                        tools_keep_special=tokens.tools_keep_special)


def single_token(tokenizer: Any, marker: str) -> int | None:
    """The marker's token id when the tokenizer encodes it as one token, else None."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _require(tokenizer: Any, markers: tuple[str, ...], flag: str) -> list[int]:
    ids = [single_token(tokenizer, marker) for marker in markers]
    missing = [marker for marker, token in zip(markers, ids, strict=True) if token is None]
    if missing:
        spelled = ", ".join(f"{marker!r} as {tokenizer.encode(marker, add_special_tokens=False)}"
                            for marker in missing)
        raise ValueError(f"{flag} needs the tokenizer to hold {' and '.join(markers)} as single tokens, and it "
                         f"splits {spelled}: this model does not write that format (choose the parser of its "
                         "family, or none)")
    return [token for token in ids if token is not None]


def _any_dropped(tokenizer: Any, decode: Any, markers: tuple[str, ...]) -> bool:
    """Whether decoding with special tokens skipped loses one of these markers (it is a special token)."""
    for marker in markers:
        token = single_token(tokenizer, marker)
        if token is not None and decode([token], skip_special_tokens=True) != marker:
            return True
    return False
