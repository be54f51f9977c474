"""Dense float32 projections on CPU through oneDNN, each weight reordered once into oneDNN's blocked
layout (torch's mkldnn linear ops, the ones inductor's CPU freezing uses), instead of MKL's sgemm on
the plain [out, in] weight.

Why: it is faster at the row counts of decode steps and the head, slightly slower for long prefill
chunks (figures in docs/BENCHMARKS.md, section 14.4, "The dense fp32 path"). And a row's result came
out bitwise the same however many rows shared the call, where MKL's sgemm picks its kernel by the row
count (one row, two to four, five and more gave three different results for the same row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The row count oneDNN is told to expect when it chooses the blocked layout (a decode step's batch).
EXPECTED_ROWS = 32


def available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether float32 weights on this device can be reordered for oneDNN (torch built with it)."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] float32 as a oneDNN tensor in its blocked layout (same shape, opaque storage)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), EXPECTED_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through oneDNN where the weight was reordered for it."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
