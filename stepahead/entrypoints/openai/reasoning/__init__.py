"""Reasoning parsers, by --reasoning-parser name (vLLM's names): the markers around a model's reasoning and
how its output begins.

deepseek_r1: `<think>`...`</think>`; the chat template opens `<think>` in the prompt, so the output is
reasoning until `</think>` (all of it if that never comes). qwen3: the same markers, reasoning only when the
output itself opens with `<think>` (with `chat_template_kwargs: {"enable_thinking": false}` the template
closes an empty think block in the prompt and the output is all content). mistral (Magistral):
`[THINK]`...`[/THINK]`, special tokens of its tokenizer, reasoning only when the output opens with
`[THINK]`. seed_oss (Seed-OSS): `<seed:think>`...`</seed:think>`, begun in reasoning as deepseek_r1.
Whichever, a prompt that ends by closing the reasoning leaves the output all content.

A grammar (response_format, structured outputs, required or named tool calls) constrains only what
follows the reasoning: the engine's reasoning gate waits for the end marker's token (and reads the start
marker's where the output must open with it), so the server refuses to start when the tokenizer does not
hold both markers as single tokens (entrypoints/openai/parser_tokens.py)."""

from __future__ import annotations

from dataclasses import dataclass

from stepahead.entrypoints.openai.reasoning.base import ReasoningStream


@dataclass(frozen=True)
class ReasoningParser:
    start: str  # the marker that opens the reasoning
    end: str  # the marker that closes it
    in_reasoning: bool  # the output begins in reasoning; else only when it opens with `start`

    def __call__(self, closed_in_prompt: bool = False) -> ReasoningStream:
        """A stream for one choice; closed_in_prompt: the prompt ended the reasoning (see closes_reasoning)."""
        return ReasoningStream(self.start, self.end, in_reasoning=self.in_reasoning and not closed_in_prompt,
                               may_open=not closed_in_prompt)

    def closes_reasoning(self, prompt: str) -> bool:
        """The prompt ends by closing the reasoning (qwen3's enable_thinking false, or an assistant turn
        continued after its reasoning): the output holds no reasoning."""
        return prompt.rstrip().endswith(self.end)


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("<think>", "</think>", in_reasoning=True),
    "qwen3": ReasoningParser("<think>", "</think>", in_reasoning=False),
    "mistral": ReasoningParser("[THINK]", "[/THINK]", in_reasoning=False),
    "seed_oss": ReasoningParser("<seed:think>", "</seed:think>", in_reasoning=True),
}
