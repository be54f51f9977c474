"""Reasoning parsers, by --reasoning-parser name: how a model's output begins.

deepseek_r1: the chat template opens `<think>` in the prompt, so the output is reasoning until `</think>`
(all of it if that never comes); qwen3: reasoning only when the output itself opens with `<think>`
(with `chat_template_kwargs: {"enable_thinking": false}` the template closes an empty think block in the
prompt and the output is all content)."""

from __future__ import annotations

from collections.abc import Callable

from stepahead.entrypoints.openai.reasoning.base import ReasoningStream

REASONING_PARSERS: dict[str, Callable[[], ReasoningStream]] = {
    "deepseek_r1": lambda: ReasoningStream(in_reasoning=True),
    "qwen3": lambda: ReasoningStream(in_reasoning=False),
}
