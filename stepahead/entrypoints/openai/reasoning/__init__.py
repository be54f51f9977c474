"""Reasoning parsers, by --reasoning-parser name: how a model's output begins.

deepseek_r1: the chat template opens `<think>` in the prompt, so the output is reasoning until `</think>`
(all of it if that never comes); qwen3: reasoning only when the output itself opens with `<think>`
(with `chat_template_kwargs: {"enable_thinking": false}` the template closes an empty think block in the
prompt and the output is all content). Either way a prompt that ends by closing a think block leaves
the output all content. A grammar (response_format, structured outputs, required or named tool calls)
constrains only what follows the reasoning: `ReasoningParser.markers` are the token ids the engine's
reasoning gate waits for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stepahead.entrypoints.openai.reasoning.base import THINK_END, THINK_START, ReasoningStream


@dataclass(frozen=True)
class ReasoningParser:
    in_reasoning: bool  # the output begins in reasoning; else only when it opens with THINK_START

    def __call__(self, closed_in_prompt: bool = False) -> ReasoningStream:
        """A stream for one choice; closed_in_prompt: the prompt ended the reasoning (see closes_reasoning)."""
        return ReasoningStream(in_reasoning=self.in_reasoning and not closed_in_prompt,
                               may_open=not closed_in_prompt)

    def markers(self, tokenizer: Any) -> tuple[list[int], list[int] | None]:
        """The end marker's token ids, and the start marker's where the output must open with it to reason."""
        end = tokenizer.encode(THINK_END, add_special_tokens=False)
        start = None if self.in_reasoning else tokenizer.encode(THINK_START, add_special_tokens=False)
        return end, start


def closes_reasoning(prompt: str) -> bool:
    """The prompt ends by closing a think block (qwen3's enable_thinking false, or an assistant turn
    continued after its reasoning): the output holds no reasoning."""
    return prompt.rstrip().endswith(THINK_END)


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser(in_reasoning=True),
    "qwen3": ReasoningParser(in_reasoning=False),
}
