"""Linear layers whose weights stay packed, run with torch's weight-only CPU kernels.

- Int4Linear: 4-bit codes with a scale and an offset per group of inputs (GGUF Q4_0/Q4_1, or
  --quantization int4), packed by `torch._convert_weight_to_int4pack_for_cpu` and multiplied by
  `torch._weight_int4pack_mm_for_cpu`. That kernel computes  (q - 8) * scale + zero  per group, so
  a code's offset `min` becomes zero = min + 8 * scale.
- Int8Linear: int8 codes with one scale per row (GGUF Q8_0 requantized per row, or --quantization
  int8), multiplied by `torch._weight_int8pack_mm`.

Both take activations in bfloat16 internally: on this kind of CPU (AVX-512 BF16, no AMX) the fp32
variants of these kernels are 5-30x slower than their bf16 ones (docs/BENCHMARKS.md section 14), and
the bf16 rounding of activations is far below the weights' own quantization error. Inputs and
outputs keep the model's dtype. A step of few tokens reads 0.56 (int4) or 1 (int8) byte per weight
instead of 4: such steps are bound by reading the weights.

Steps of many tokens are bound by arithmetic instead, and there these weight-only kernels lose to
torch's dense fp32 GEMM on this CPU (2x slower at 256 tokens, about even at 32). So a module may
also keep the dequantized weight (`dense`, in the model's dtype) and use it for steps of more than
`packed_max_tokens` rows: both paths multiply by the same quantized values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stepahead.models.quant_weights import GroupQuantWeight, to_int8_rows

KERNEL_DTYPE = torch.bfloat16
# Steps with more rows than this use the dense copy when the module keeps one (measured crossover,
# docs/BENCHMARKS.md section 14).
PACKED_MAX_TOKENS = 16


class _PackedBase(nn.Module):
    """What both packed linears share: the forward around their kernel (_packed_mm), the bias and the
    dense fallback."""

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("dense", None)
        self.packed_max_tokens = PACKED_MAX_TOKENS
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def _packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        """[rows, in] KERNEL_DTYPE activations times the packed weight: [rows, out]."""
        raise NotImplementedError

    def keep_dense(self, weight: torch.Tensor, max_tokens: int = PACKED_MAX_TOKENS) -> None:
        """Also keep the dequantized weight [out, in], for steps of more than max_tokens rows."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"dense weight has shape {tuple(weight.shape)}, expected "
                             f"{(self.out_features, self.in_features)}")
        self.dense = weight.contiguous()
        self.packed_max_tokens = max_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.numel() > self.packed_max_tokens * self.in_features:
            return F.linear(x, self.dense, self.bias)
        y = self._packed_mm(x.reshape(-1, self.in_features).to(KERNEL_DTYPE))
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(_PackedBase):
    def __init__(self, weight: GroupQuantWeight, bias: torch.Tensor | None = None) -> None:
        if weight.bits != 4 or weight.mins is None:
            raise ValueError("Int4Linear needs 4-bit codes with per-group offsets")
        super().__init__(*weight.shape, bias)
        self.group_size = weight.group_size
        packed = torch._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32).contiguous(), 1)
        zeros = weight.mins + 8 * weight.scales
        # [in // group, out, 2]: scale and zero of each group, the kernel's layout.
        scales_zeros = torch.stack((weight.scales.t(), zeros.t()), dim=-1).to(KERNEL_DTYPE).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)

    def _packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_zeros)

    def dequantized_weight(self) -> torch.Tensor:
        """The [out, in] float32 weight the kernel multiplies with (identity input through the kernel)."""
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, self.scales_zeros).float().t()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class Int8Linear(_PackedBase):
    def __init__(self, weight: GroupQuantWeight, bias: torch.Tensor | None = None) -> None:
        rows = to_int8_rows(weight)
        super().__init__(*rows.shape, bias)
        self.register_buffer("qweight", rows.q.contiguous())
        self.register_buffer("scales", rows.scales.reshape(-1).to(KERNEL_DTYPE).contiguous())

    def _packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(flat, self.qweight, self.scales)

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float().unsqueeze(1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def set_packed_max_tokens(model: nn.Module, max_tokens: int) -> int:
    """Set the row threshold of every packed module of model (a large value: always the packed
    kernels, as quality checks need); returns how many modules were changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, _PackedBase):
            module.packed_max_tokens = max_tokens
            changed += 1
    return changed


def quantized_linear(weight: GroupQuantWeight, bias: torch.Tensor | None = None) -> nn.Module:
    """The packed module for a quantized weight: 4-bit group codes -> Int4Linear, 8-bit -> Int8Linear."""
    if weight.bits == 4:
        return Int4Linear(weight, bias)
    return Int8Linear(weight, bias)
