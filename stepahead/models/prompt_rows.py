"""PromptRows: which rows of a step's flattened batch hold prompt tokens.

With packed weights (models/quantized_linear.py) prompt tokens run on the dense weights and generated
tokens on the packed kernels. What decides a token's path is the token itself (is it part of its
request's prompt?), never the batch it shares, so a request's tokens stay the same async or sync,
preempted or not, chunked or not: a generated token recomputed after a preemption runs the packed
kernels again. Prompts are prefilled many tokens at a time, where dense fp32 GEMM is 2-2.6x faster
than the packed kernels; generated tokens come a few per step, where reading 0.56 bytes per weight
instead of 4 wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptRows:
    """Prompt rows of a step with both kinds; None stands for "no prompt rows" and ALL_PROMPT_ROWS
    for "every row is a prompt token" (no index needed)."""

    index: torch.Tensor | None  # [n] long: the prompt rows (None: every row)
    others: torch.Tensor | None  # [m] long: the generated-token rows

    @property
    def all(self) -> bool:
        return self.index is None


ALL_PROMPT_ROWS = PromptRows(None, None)
