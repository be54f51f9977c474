"""Quantized weights as plain tensors: GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks decoded without dequantizing, and
dense weights quantized the same way (for `--quantization int4|int8` on safetensors checkpoints).

A GroupQuantWeight is one [out, in] matrix as integer codes with one scale (and, for 4 bits, one
offset) per group of `group_size` consecutive inputs of a row:  w[r, c] = q[r, c] * scale[r, g] + min[r, g]
with g = c // group_size. That is exactly GGUF's block formats (32 weights a block):

- Q4_0: fp16 d, 16 bytes of nibbles;  w = (q - 8) * d           -> q in 0..15, scale d, min -8 d
- Q4_1: fp16 d, fp16 m, 16 bytes;     w = q * d + m             -> q in 0..15, scale d, min m
- Q8_0: fp16 d, 32 int8;              w = q * d                 -> q in -127..127, scale d, no min
- Q5_0: fp16 d, 4 bytes of fifth bits, 16 bytes;  w = (q - 16) * d  -> q in 0..31, scale d, min -16 d
- Q5_1: fp16 d, fp16 m, 4 bytes, 16 bytes;      w = q * d + m        -> q in 0..31, scale d, min m
  (llama.cpp's fallbacks for Q4_K and Q5_K where a row is not a whole number of 256-weight blocks:
  a Q4_K_M file of a model 576 wide is mostly Q5_0)

In a block, byte j holds element j in its low nibble and element j + 16 in its high nibble.
Rows are independent, so un-permuting llama.cpp's Q/K rows and fusing q/k/v or gate/up (row
concatenation) work on the codes directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

GGUF_BLOCK = 32
# GGUF tensor type name -> (bytes per block, bits)
GGUF_QUANT_TYPES = {"Q4_0": (18, 4), "Q4_1": (20, 4), "Q5_0": (22, 5), "Q5_1": (24, 5), "Q8_0": (34, 8)}


@dataclass
class GroupQuantWeight:
    """An [out, in] weight as integer codes with per-group scales (and offsets for 4 and 5 bits)."""

    q: torch.Tensor  # [out, in]: uint8 codes 0..15 (bits 4) or 0..31 (bits 5), or int8 codes (bits 8)
    scales: torch.Tensor  # [out, in // group_size] float32
    mins: torch.Tensor | None  # [out, in // group_size] float32 (bits 4, 5), or None (symmetric)
    group_size: int
    bits: int

    def __post_init__(self) -> None:
        if self.bits not in (4, 5, 8):
            raise ValueError(f"bits must be 4, 5 or 8, got {self.bits}")
        out_features, in_features = self.q.shape
        if in_features % self.group_size:
            raise ValueError(f"in_features {in_features} is not a multiple of group_size {self.group_size}")
        if tuple(self.scales.shape) != (out_features, in_features // self.group_size):
            raise ValueError(f"scales have shape {tuple(self.scales.shape)}, expected "
                             f"{(out_features, in_features // self.group_size)}")

    @property
    def shape(self) -> tuple[int, int]:
        return cast(tuple[int, int], tuple(self.q.shape))  # 2-D, checked above

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the codes stand for."""
        out_features, in_features = self.q.shape
        groups = self.q.view(out_features, -1, self.group_size).float() * self.scales.unsqueeze(-1)
        if self.mins is not None:
            groups = groups + self.mins.unsqueeze(-1)
        return groups.reshape(out_features, in_features)

    def take_rows(self, index: torch.Tensor | np.ndarray) -> GroupQuantWeight:
        index = torch.as_tensor(index, dtype=torch.long)
        return GroupQuantWeight(self.q[index], self.scales[index],
                                None if self.mins is None else self.mins[index], self.group_size, self.bits)


def cat_rows(parts: list[GroupQuantWeight]) -> GroupQuantWeight:
    """The row concatenation of weights quantized alike (a fused qkv or gate/up projection)."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.mins is None) != (first.bits, first.group_size, first.mins is None):
            raise ValueError("cannot fuse weights quantized differently "
                             f"({first.bits}-bit/{first.group_size} and {p.bits}-bit/{p.group_size})")
    mins = None if first.mins is None else torch.cat([cast(torch.Tensor, p.mins) for p in parts])  # all have mins (checked)
    return GroupQuantWeight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), mins,
                            first.group_size, first.bits)


def decode_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> GroupQuantWeight:
    """A GGUF tensor's raw bytes (any shape, C order) of a GGUF_QUANT_TYPES type as codes and scales.

    shape is the weight's [out, in] (GGUF lists dimensions the other way round)."""
    if type_name not in GGUF_QUANT_TYPES:
        raise ValueError(f"GGUF type {type_name!r} is not kept quantized (supported: {', '.join(GGUF_QUANT_TYPES)})")
    block_bytes, bits = GGUF_QUANT_TYPES[type_name]
    rows, cols = shape
    if cols % GGUF_BLOCK:
        raise ValueError(f"a {type_name} row of {cols} weights is not a whole number of {GGUF_BLOCK}-weight blocks")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // GGUF_BLOCK, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return GroupQuantWeight(torch.from_numpy(q), torch.from_numpy(d), None, GGUF_BLOCK, 8)
    if type_name in ("Q5_0", "Q5_1"):  # bit j of the 32-bit qh is element j's fifth bit
        at = 2 if type_name == "Q5_0" else 4
        fifth = (blocks[..., at:at + 4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        nibbles = blocks[..., at + 4:]
        q5 = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1) | (fifth.astype(np.uint8) << 4)
        mins = -16.0 * d if type_name == "Q5_0" else blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return GroupQuantWeight(torch.from_numpy(np.ascontiguousarray(q5, dtype=np.uint8).reshape(rows, cols)),
                                torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(mins)), GGUF_BLOCK, 5)
    if type_name == "Q4_1":
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]
    else:
        mins = -8.0 * d
        nibbles = blocks[..., 2:]
    q = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(rows, cols)
    return GroupQuantWeight(torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)), torch.from_numpy(d),
                            torch.from_numpy(np.ascontiguousarray(mins)), GGUF_BLOCK, 4)


def as_symmetric_int8(weight: GroupQuantWeight) -> GroupQuantWeight | None:
    """The same values as int8 codes with the same scales and no min, where that is exact: Q8_0 itself,
    and Q4_0 / Q5_0, whose min is -8 or -16 times the scale (codes q - 8, q - 16). None otherwise. A
    projection fused from Q5_0 and Q8_0 parts (a Q4_K_M file's q/k and v) is packed so, as one weight."""
    if weight.mins is None:
        return weight
    offset = 1 << (weight.bits - 1)
    if weight.bits == 8 or not torch.equal(weight.mins, -offset * weight.scales):
        return None
    q = (weight.q.to(torch.int16) - offset).to(torch.int8)
    return GroupQuantWeight(q, weight.scales, None, weight.group_size, 8)


def quantize_int4(w: torch.Tensor, group_size: int = GGUF_BLOCK) -> GroupQuantWeight:
    """Asymmetric 4-bit codes per group of group_size inputs (min/max mapped to 0/15), like Q4_1: the
    scales and mins are float16 values, as GGUF stores them and the CPU kernels read them."""
    rows, cols = w.shape
    groups = w.detach().float().reshape(rows, cols // group_size, group_size)
    lo, hi = groups.amin(-1).half().float(), groups.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=2.0**-24).half().float()  # float16's smallest step
    q = ((groups - lo.unsqueeze(-1)) / scales.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    return GroupQuantWeight(q.reshape(rows, cols), scales, lo, group_size, 4)


def quantize_int8_rows(w: torch.Tensor) -> GroupQuantWeight:
    """Symmetric 8-bit codes with one scale per row (the layout torch's int8 weight-only kernel reads).
    The scales are float16 values: a row of 32 inputs is one Q8_0 block, which stepahead's kernel runs
    and which keeps its scales as float16."""
    w = w.detach().float()
    scales = (w.abs().amax(1, keepdim=True) / 127).clamp(min=2.0**-24).half().float()
    q = (w / scales).round().clamp(-127, 127).to(torch.int8)
    return GroupQuantWeight(q, scales, None, w.shape[1], 8)


def to_int8_rows(weight: GroupQuantWeight) -> GroupQuantWeight:
    """Any quantized weight as per-row int8 (Q8_0's per-block scales requantized; exact when a row
    has one scale already)."""
    if weight.bits == 8 and weight.mins is None and weight.group_size == weight.shape[1]:
        return weight
    return quantize_int8_rows(weight.dequantize())
