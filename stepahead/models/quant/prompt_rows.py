"""PromptRows: which rows of a step's flattened batch hold prompt tokens, and the dense GEMM they run.

With packed weights on torch's weight-only kernels (models/quant/quantized_linear.py; stepahead's own CPU
kernels run every row, being faster than fp32 GEMM at any row count) prompt tokens run on the dense
weights and generated tokens on the packed kernels. What decides a token's path is the token itself
(is it part of its request's prompt?), never the batch it shares, so a request's tokens stay the
same async or sync, preempted or not, chunked or not: a generated token recomputed after a
preemption runs the packed kernels again. Prompts are prefilled many tokens at a time, where dense
fp32 GEMM is several times faster than torch's weight-only kernels; generated tokens come a few per
step, where reading 0.56-0.63 bytes per weight instead of 4 wins.

Two things keep a prompt row's result independent of everything but the row:
- BLAS takes other code paths for a few rows (a matrix-vector product for one row, small-matrix
  kernels below about 12 rows on the build machine), and those round differently. dense_rows pads
  every call to a multiple of ROW_TILE rows, and rows_are_invariant checks at load, on the machine's
  own BLAS, that a row's result depends neither on its position nor on the call's size; where it
  does, prompt rows stay packed.
- Attention is not bitwise the same for a token prefilled in one chunk and in another chunking (a
  longer batch, or a recompute after a preemption behind a cached prefix: other SDPA layouts). The
  packed kernels round their inputs and outputs to bfloat16, which absorbs such last-bit differences
  almost always; with fp32 in and out, prompt tokens carried them through every layer, and the
  structured-output batch's tokens changed after a preemption. dense_rows rounds its input and
  output the same way, so prompt tokens are exactly as sensitive as packed ones: it keeps the packed
  path's precision and only swaps the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stepahead.kernels import cpu_build, cpu_ops

ROW_TILE = 16
# Row counts rows_are_invariant compares (steps of more rows are assumed to behave like 512). BLAS
# libraries pick their blocking by the row count in ranges, so the check samples each range.
CHECKED_ROW_COUNTS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# The activation dtype of the packed kernels (models/quant/quantized_linear.py takes it from here) and of dense_rows.
ACTIVATION_ROUNDING = torch.bfloat16


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


def dense_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] times weight [out, in] as the packed kernels round it (input and output in
    ACTIVATION_ROUNDING, bias added after), one GEMM call with n padded by zero rows to a multiple of ROW_TILE."""
    n = x.shape[0]
    pad = -n % ROW_TILE
    if x.dtype == torch.float32 and cpu_build.available():  # the same rounding in place, without copies
        rounded = torch.cat((x, x.new_zeros(pad, x.shape[1])))
        cpu_ops.round_to_bf16_(rounded)
        y = F.linear(rounded, weight)[:n]
        cpu_ops.round_to_bf16_(y)
    else:
        rounded = x.new_zeros(n + pad, x.shape[1])
        rounded[:n] = x.to(ACTIVATION_ROUNDING)
        y = F.linear(rounded, weight)[:n]
        y = y.to(ACTIVATION_ROUNDING).to(x.dtype)
    return y if bias is None else y + bias


def rows_are_invariant(weight: torch.Tensor) -> bool:
    """Whether dense_rows computes a row bitwise the same at any position of a call of any size
    (CHECKED_ROW_COUNTS rows, starting at the first row or a later one) as in a call of one tile. The
    bias is added outside the GEMM, row by row, so it cannot change the answer."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max(CHECKED_ROW_COUNTS) + ROW_TILE, weight.shape[1], generator=gen).to(weight.dtype)
    reference = torch.cat([dense_rows(x[i:i + ROW_TILE], weight, None) for i in range(0, x.shape[0], ROW_TILE)])
    for n in CHECKED_ROW_COUNTS:
        for start in (0, 7):
            if not torch.equal(dense_rows(x[start:start + n], weight, None), reference[start:start + n]):
                return False
    return True
