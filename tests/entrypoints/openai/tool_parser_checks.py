"""What the tool-call parser tests share: feeding a stream in pieces, checking that every split of an
output reads as the whole output does, and the model's own turn as a chat template writes it."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from stepahead.entrypoints.openai.protocol import ChatMessage
from stepahead.entrypoints.openai.serving_chat import render_chat
from stepahead.entrypoints.openai.tool_calling.parsers import TOOL_PARSERS
from stepahead.entrypoints.openai.tool_calling.parsers.base import StreamDelta, ToolCall, ToolStream, collect
from stepahead.entrypoints.openai.tool_calling.tools import Function

TEMPLATES = Path(__file__).parent / "chat_templates"


def streamed(stream: ToolStream, pieces: Sequence[str]) -> tuple[str, dict[int, dict]]:
    """Feed the pieces in turn; the content and the calls the deltas assemble."""
    out = StreamDelta()
    for piece in pieces:
        out += stream.feed(piece)
    out += stream.finish()
    calls: dict[int, dict] = {}
    for delta in out.tool_calls:
        call = calls.setdefault(delta["index"], {"arguments": ""})
        if "id" in delta:
            assert call == {"arguments": ""}, "id and name come first, once"
            call.update(id=delta["id"], name=delta["function"]["name"])
        else:
            assert "id" in call, "arguments come after their call's id and name"
        call["arguments"] += delta["function"]["arguments"]
    return out.content, calls


def splits(text: str, tokens: Sequence[str] = ()) -> Iterator[list[str]]:
    """The ways the output may arrive: a character at a time, in pieces of a few characters, in two at every
    position (each marker cut everywhere), and in `tokens`, the pieces a tokenizer decodes it to."""
    for size in (1, 2, 3, 5, 7):
        yield [text[i:i + size] for i in range(0, len(text), size)]
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    if tokens:
        assert "".join(tokens) == text
        yield list(tokens)


def read(parser: str, text: str, functions: Sequence[Function] = (),
         tokens: Sequence[str] = ()) -> tuple[str | None, list[tuple[str, object]]]:
    """The content and the (name, arguments) calls of a whole output, after checking every split of it
    streams the same calls (and the same content, which the whole output gives as None when blank)."""
    content, calls = collect(TOOL_PARSERS[parser].for_tools(functions), text)
    whole = [(call.name, json.loads(call.arguments)) for call in calls]
    for pieces in splits(text, tokens):
        streamed_content, streamed_calls = streamed(TOOL_PARSERS[parser].for_tools(functions), pieces)
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls.values()] == whole, pieces
        assert (streamed_content or None) == (content or None) if whole else streamed_content == text, pieces
    return content, whole


def family_tokenizer(folder: Path, special: Sequence[str] = (), added: Sequence[str] = ()):
    """The tiny tokenizer with a family's markers as tokens of their own: `special` ones (control tokens,
    as Mistral's [TOOL_CALLS]) and ordinary `added` ones (as Qwen's <tool_call>)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(list(added))
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    return tokenizer


def token_pieces(tokenizer, text: str) -> list[str]:
    """The output as a model writes it: the text of each of its tokens in turn."""
    return [tokenizer.decode([token]) for token in tokenizer.encode(text, add_special_tokens=False)]


def calls_of(parser: str, text: str, functions: Sequence[Function] = ()) -> list[ToolCall]:
    """The calls of a whole output as the server returns them (with their ids)."""
    return collect(TOOL_PARSERS[parser].for_tools(functions), text)[1]


def template_output(tokenizer, template: str, history: list[dict], tools: list[dict], end: str) -> str:
    """What the template writes for the last message, the assistant's: the rendering of the whole history
    past the prompt the template makes of the messages before it, less `end`, the end of the turn."""
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    messages = [ChatMessage.model_validate(message) for message in history]
    prompt = render_chat(tokenizer, messages[:-1], True, False, None, tools=tools)
    full = render_chat(tokenizer, messages, False, False, None, tools=tools)
    assert full.startswith(prompt), (prompt, full)
    turn = full[len(prompt):]
    assert turn.endswith(end), turn
    return turn[:-len(end)]


def assistant_turn(calls: list[ToolCall], content: str | None = None) -> dict:
    """The calls as a client sends them back on the next turn."""
    return {"role": "assistant", "content": content, "tool_calls": [call.to_openai() for call in calls]}
