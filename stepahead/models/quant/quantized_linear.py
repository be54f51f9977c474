"""Linear layers whose weights stay packed, run with weight-only CPU kernels.

- Int4Linear: 4-bit codes with a scale and an offset per group of inputs (GGUF Q4_0/Q4_1, or
  --quantization int4). With groups of 32 on an AVX2 CPU it keeps GGUF's codes and scales, in tiles
  of eight columns that a thread reads as one stream (kernels/packed_gemm.h), and runs stepahead's own
  kernel (kernels/packed_gemm.cpp: activations quantized to 16-bit integers per group of 32, exact
  integer dot products). Otherwise the codes are packed
  by `torch._convert_weight_to_int4pack_for_cpu` and multiplied by `torch._weight_int4pack_mm_for_cpu`,
  which computes  (q - 8) * scale + zero  per group (a code's offset `min` becomes
  zero = min + 8 * scale) on bfloat16 activations.
- KQuantLinear: llama.cpp's k-quants (Q4_K, Q5_K, Q6_K), their super-block factors kept as the file
  holds them (models/quant/kquant_tiles.py), on stepahead's kernel only: torch has no kernel for them, so
  where ours is not built such weights stay dense (models/quant/quantized_loader.py).
- Int8Linear: int8 codes. GGUF's Q8_0 (a scale per group of 32) on an AVX2 CPU runs stepahead's
  8-bit kernel of the same kind (packed_gemm.cpp); otherwise (and for --quantization int8, one scale
  per row) `torch._weight_int8pack_mm` on bfloat16 activations, Q8_0 requantized per row.

torch's kernels take bfloat16 activations: their fp32 variants are many times slower (docs/BENCHMARKS.md
section 14.4), and the rounding is far below the weights' own quantization error. Every kernel rounds
its outputs to bfloat16 values. Inputs and outputs keep the model's dtype. A step of few tokens reads
0.56-0.63 (int4) or 1 (int8) byte per weight instead of 4: such steps are bound by reading the weights.

A module on torch's kernels also keeps its dequantized weight (`dense`, the same values in the
model's dtype) for prompt tokens (models/quant/prompt_rows.py), unless this machine's BLAS fails the
row-invariance check at load: prefill steps of many tokens are bound by arithmetic, where torch's
fp32 GEMM is several times faster than torch's weight-only kernels (stepahead's own kernel is faster
than both and runs every row; models/quant/quantized_loader.py). Generated tokens always run the packed
kernel, which computes each row on its own (a row's output is bitwise the same alone or among 512
rows, tested), so a token's path and result depend on the token, not on the batch it shares.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from stepahead.kernels import cpu_packed
from stepahead.models.quant import kquant_tiles
from stepahead.models.quant.kquant_weights import KQuantWeight
from stepahead.models.quant.prompt_rows import ACTIVATION_ROUNDING, PromptRows, dense_rows
from stepahead.models.quant.quant_weights import GroupQuantWeight, to_int8_rows

KERNEL_DTYPE = ACTIVATION_ROUNDING  # the dense path of prompt rows rounds activations the same way


class _PackedBase(nn.Module):
    """What both packed linears share: the forward around their kernel (_packed_mm), the bias and the
    dense weight prompt rows use."""

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("dense", None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def _packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        """[rows, in] activations (the model's dtype) times the packed weight: [rows, out], in the
        kernel's output dtype."""
        raise NotImplementedError

    def keep_dense(self, weight: torch.Tensor) -> None:
        """Keep the dequantized weight [out, in] for prompt rows."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"dense weight has shape {tuple(weight.shape)}, expected "
                             f"{(self.out_features, self.in_features)}")
        self.dense = weight.contiguous()

    def forward(self, x: torch.Tensor, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """x [T, in]; prompt_rows: which of the T rows run on the dense weight (None: none of them)."""
        if prompt_rows is None or self.dense is None:
            return self._packed(x)
        if prompt_rows.all:
            return dense_rows(x, self.dense, self.bias)
        y = x.new_empty(x.shape[0], self.out_features)
        y.index_copy_(0, prompt_rows.index, dense_rows(x.index_select(0, prompt_rows.index), self.dense, self.bias))
        return y.index_copy_(0, prompt_rows.others, self._packed(x.index_select(0, prompt_rows.others)))

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        y = self._packed_mm(x.reshape(-1, self.in_features))
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(_PackedBase):
    """4-bit codes with offsets; also GGUF's 5-bit Q5_0 / Q5_1, on stepahead's kernel only."""

    def __init__(self, weight: GroupQuantWeight, bias: torch.Tensor | None = None) -> None:
        if weight.bits not in (4, 5) or weight.mins is None:
            raise ValueError("Int4Linear needs 4- or 5-bit codes with per-group offsets")
        super().__init__(*weight.shape, bias)
        self.group_size, self.bits = weight.group_size, weight.bits
        self.kernel = cpu_packed.kernel_for(self.group_size)
        if weight.bits == 5 and self.kernel != "stepahead":
            raise ValueError("5-bit codes run on stepahead's kernel only (groups of 32, kernels built)")
        if self.kernel == "stepahead":
            tile = cpu_packed.tile_q4 if weight.bits == 4 else cpu_packed.tile_q5
            self.register_buffer("tiles", tile(weight.q, weight.scales, weight.mins))
            return
        packed = torch._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32).contiguous(), 1)
        zeros = weight.mins + 8 * weight.scales
        # [in // group, out, 2]: scale and zero of each group, the kernel's layout.
        scales_zeros = torch.stack((weight.scales.t(), zeros.t()), dim=-1).to(KERNEL_DTYPE).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)

    def _packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        if self.kernel == "stepahead":
            return cpu_packed.int4_gemm(flat.float(), self.tiles, self.out_features)
        return torch._weight_int4pack_mm_for_cpu(flat.to(KERNEL_DTYPE), self.packed, self.group_size,
                                                 self.scales_zeros)

    def dequantized_weight(self) -> torch.Tensor:
        """The [out, in] float32 weight the kernel multiplies with."""
        if self.kernel == "stepahead":
            codes, scales, mins = cpu_packed.untile(self.tiles, self.out_features)
            return GroupQuantWeight(codes, scales, mins, self.group_size, self.bits).dequantize()
        # torch's kernel through an identity input: its weight with bf16 scales and zeros.
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, self.scales_zeros).float().t()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bits={self.bits}, kernel={self.kernel}")


class Int8Linear(_PackedBase):
    def __init__(self, weight: GroupQuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__(*weight.shape, bias)
        self.kernel = cpu_packed.kernel_for(weight.group_size)
        if self.kernel == "stepahead":  # GGUF's Q8_0 blocks, in tiles of eight columns
            self.register_buffer("tiles", cpu_packed.tile_q8(weight.q, weight.scales))
            return
        rows = to_int8_rows(weight)  # torch's kernel takes one scale per row
        self.register_buffer("qweight", rows.q.contiguous())
        self.register_buffer("scales", rows.scales.reshape(-1).to(KERNEL_DTYPE).contiguous())

    def _packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        if self.kernel == "stepahead":
            return cpu_packed.int8_gemm(flat.float(), self.tiles, self.out_features)
        return torch._weight_int8pack_mm(flat.to(KERNEL_DTYPE), self.qweight, self.scales)

    def dequantized_weight(self) -> torch.Tensor:
        if self.kernel == "stepahead":
            codes, scales, _ = cpu_packed.untile(self.tiles, self.out_features)
            return GroupQuantWeight(codes, scales, None, cpu_packed.GROUP, 8).dequantize()
        return self.qweight.float() * self.scales.float().unsqueeze(1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


class KQuantLinear(_PackedBase):
    """A Q4_K / Q5_K / Q6_K weight on stepahead's kernel (needs it built: cpu_packed.available())."""

    kernel = "stepahead"

    def __init__(self, weight: KQuantWeight, bias: torch.Tensor | None = None) -> None:
        if not cpu_packed.available():
            raise ValueError("k-quant weights run on stepahead's CPU kernels only, which are not built here")
        super().__init__(*weight.shape, bias)
        self.type_name = weight.type_name
        self.register_buffer("tiles", kquant_tiles.tile_kquant(weight))

    def _packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        return cpu_packed.packed_gemm(flat.float(), self.tiles, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return kquant_tiles.untile_kquant(self.tiles, self.out_features, self.type_name).dequantize()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={self.type_name}, kernel={self.kernel}")


class PackedParts(_PackedBase):
    """A fused projection (q/k/v, gate/up) whose parts are packed in different formats, as llama.cpp's
    Q4_K_M gives some layers' v more bits than q and k: each part runs its own kernel and the outputs
    lie side by side. Parts must be on stepahead's kernel, and each but the last whole tiles of eight
    columns (DecodeStack runs them the same way: packed_gemm.h, PackedParts)."""

    kernel = "stepahead"

    def __init__(self, parts: list[nn.Module], bias: torch.Tensor | None = None) -> None:
        if any(getattr(p, "kernel", None) != "stepahead" or getattr(p, "tiles", None) is None for p in parts):
            raise ValueError("PackedParts needs parts packed on stepahead's kernel")
        sizes = [int(p.out_features) for p in parts]
        if any(size % cpu_packed.TILE for size in sizes[:-1]):
            raise ValueError(f"every part but the last needs a multiple of {cpu_packed.TILE} outputs")
        super().__init__(sum(sizes), int(parts[0].in_features), bias)
        self.parts = nn.ModuleList(parts)

    def _packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.cat([part._packed_mm(flat) for part in self.parts], dim=-1)

    def dequantized_weight(self) -> torch.Tensor:
        return torch.cat([part.dequantized_weight() for part in self.parts])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, parts={len(self.parts)}"


def packed_tiles(projection: nn.Module) -> list[torch.Tensor] | None:
    """The packed tiles of a projection's parts (one, or PackedParts' several), or None where it does not
    run stepahead's packed kernel."""
    if isinstance(projection, PackedParts):
        return [cast(torch.Tensor, part.tiles) for part in projection.parts]
    if isinstance(projection, Int4Linear | Int8Linear | KQuantLinear) and projection.kernel == "stepahead":
        return [cast(torch.Tensor, projection.tiles)]
    return None


def quantized_linear(weight: GroupQuantWeight | KQuantWeight, bias: torch.Tensor | None = None) -> nn.Module:
    """The packed module for a quantized weight: 4-bit group codes -> Int4Linear, 5-bit ones too on
    stepahead's kernel (else Int8Linear, requantized per row as Q8_0 is), 8-bit -> Int8Linear, a
    k-quant -> KQuantLinear."""
    if isinstance(weight, KQuantWeight):
        return KQuantLinear(weight, bias)
    if weight.bits == 4 or (weight.bits == 5 and cpu_packed.kernel_for(weight.group_size) == "stepahead"):
        return Int4Linear(weight, bias)
    return Int8Linear(weight, bias)
