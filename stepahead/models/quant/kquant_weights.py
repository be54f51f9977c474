"""llama.cpp's k-quants (GGUF Q4_K, Q5_K, Q6_K) as plain tensors: codes and the super-block factors,
decoded from the file's blocks without dequantizing.

A block covers 256 inputs of a row (a super-block) and holds a float16 d and sub-block scales sc:

- Q4_K: d, dmin, eight 6-bit (sc, m) pairs for sub-blocks of 32, 4-bit codes;  w = d sc q - dmin m
- Q5_K: the same with 5-bit codes (a fifth bit per weight beside the nibbles)
- Q6_K: d, sixteen int8 scales for sub-blocks of 16, 6-bit codes;             w = d sc (q - 32)

The factors are kept apart (not as per-group float scales): the kernels' records hold them as the file
does, 4.6 to 6.6 bits per weight, and d sc and dmin m are exact in float32 anyway. Rows are
independent, so un-permuting llama.cpp's Q/K rows and fusing q/k/v or gate/up work on the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

SUPER_BLOCK = 256
# GGUF type name -> bytes per block of 256 weights
KQUANT_TYPES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def sub_block(type_name: str) -> int:
    """Inputs per sub-block scale: 16 for Q6_K, 32 for Q4_K and Q5_K."""
    return 16 if type_name == "Q6_K" else 32


@dataclass
class KQuantWeight:
    """An [out, in] weight in one of llama.cpp's k-quant formats, as codes and super-block factors."""

    type_name: str  # "Q4_K", "Q5_K" or "Q6_K"
    q: torch.Tensor  # [out, in] uint8 codes: 0..15 (Q4_K), 0..31 (Q5_K), 0..63 (Q6_K)
    d: torch.Tensor  # [out, in / 256] float32 holding float16 values
    scales: torch.Tensor  # [out, in / sub_block] uint8 0..63 (Q4_K, Q5_K) or int8 (Q6_K)
    dmin: torch.Tensor | None  # [out, in / 256] float32 holding float16 values (Q4_K, Q5_K)
    mins: torch.Tensor | None  # [out, in / 32] uint8 0..63 (Q4_K, Q5_K)

    def __post_init__(self) -> None:
        if self.type_name not in KQUANT_TYPES:
            raise ValueError(f"type_name must be one of {', '.join(KQUANT_TYPES)}, got {self.type_name!r}")
        rows, cols = self.q.shape
        if cols % SUPER_BLOCK:
            raise ValueError(f"a {self.type_name} row of {cols} weights is not a whole number of "
                             f"{SUPER_BLOCK}-weight blocks")
        has_mins = self.type_name != "Q6_K"
        if (self.dmin is not None, self.mins is not None) != (has_mins, has_mins):
            raise ValueError(f"{self.type_name} {'needs' if has_mins else 'has no'} dmin and mins")
        expected = {"d": (rows, cols // SUPER_BLOCK), "scales": (rows, cols // sub_block(self.type_name))}
        if has_mins:
            expected |= {"dmin": expected["d"], "mins": (rows, cols // 32)}
        for field, shape in expected.items():
            if tuple(getattr(self, field).shape) != shape:
                raise ValueError(f"{field} has shape {tuple(getattr(self, field).shape)}, expected {shape}")

    @property
    def shape(self) -> tuple[int, int]:
        return cast(tuple[int, int], tuple(self.q.shape))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, computed as gguf's dequantization computes it (the same bits)."""
        rows, cols = self.q.shape
        per_sub = sub_block(self.type_name)
        subs_per_block = SUPER_BLOCK // per_sub
        scale = self.d.repeat_interleave(subs_per_block, dim=1) * self.scales.float()  # exact
        codes = self.q.view(rows, -1, per_sub).float()
        if self.dmin is None or self.mins is None:  # Q6_K
            return (scale.unsqueeze(-1) * (codes - 32)).reshape(rows, cols)
        offset = self.dmin.repeat_interleave(subs_per_block, dim=1) * self.mins.float()
        return (scale.unsqueeze(-1) * codes - offset.unsqueeze(-1)).reshape(rows, cols)

    def take_rows(self, index: torch.Tensor | np.ndarray) -> KQuantWeight:
        index = torch.as_tensor(index, dtype=torch.long)
        return KQuantWeight(self.type_name, self.q[index], self.d[index], self.scales[index],
                            None if self.dmin is None else self.dmin[index],
                            None if self.mins is None else self.mins[index])


def cat_kquant_rows(parts: list[KQuantWeight]) -> KQuantWeight:
    """The row concatenation of weights of one k-quant type (a fused qkv or gate/up projection)."""
    types = {p.type_name for p in parts}
    if len(types) > 1:
        raise ValueError(f"cannot fuse weights of different k-quant types ({', '.join(sorted(types))})")

    def cat(field: str) -> torch.Tensor | None:
        values = [getattr(p, field) for p in parts]
        return None if values[0] is None else torch.cat(values)

    return KQuantWeight(parts[0].type_name, cast(torch.Tensor, cat("q")), cast(torch.Tensor, cat("d")),
                        cast(torch.Tensor, cat("scales")), cat("dmin"), cat("mins"))


def decode_kquant_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> KQuantWeight:
    """A GGUF tensor's raw bytes of type Q4_K, Q5_K or Q6_K as codes and factors; shape is [out, in]."""
    import gguf.quants

    if type_name not in KQUANT_TYPES:
        raise ValueError(f"GGUF type {type_name!r} is not a k-quant (supported: {', '.join(KQUANT_TYPES)})")
    rows, cols = shape
    if cols % SUPER_BLOCK:
        raise ValueError(f"a {type_name} row of {cols} weights is not a whole number of {SUPER_BLOCK}-weight blocks")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows * (cols // SUPER_BLOCK), KQUANT_TYPES[type_name])
    n = blocks.shape[0]

    def halves(at: int) -> np.ndarray:
        return blocks[:, at:at + 2].copy().view(np.float16)[:, 0].astype(np.float32).reshape(rows, -1)

    def nibbles(qs: np.ndarray, span: int) -> np.ndarray:
        """Runs of `span` bytes hold inputs i (low nibble) and i + span (high nibble) of each 2 span."""
        q = qs.reshape(n, -1, 1, span) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        return (q & 0x0F).reshape(n, SUPER_BLOCK)

    if type_name == "Q6_K":
        low = nibbles(blocks[:, :128], 64)
        qh = blocks[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = low | ((qh & 0x03).reshape(n, SUPER_BLOCK) << 4)
        scales = blocks[:, 192:208].copy().view(np.int8).reshape(rows, -1)
        return KQuantWeight(type_name, torch.from_numpy(np.ascontiguousarray(q).reshape(rows, cols)),
                            torch.from_numpy(halves(208)), torch.from_numpy(scales), None, None)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])  # the 6-bit pairs, unpacked as gguf does
    if type_name == "Q4_K":
        q = nibbles(blocks[:, 16:], 32)
    else:
        qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = nibbles(blocks[:, 48:], 32) | ((qh & 0x01).reshape(n, SUPER_BLOCK) << 4)
    return KQuantWeight(type_name, torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8).reshape(rows, cols)),
                        torch.from_numpy(halves(0)), torch.from_numpy(np.ascontiguousarray(sc, dtype=np.uint8).reshape(rows, -1)),
                        torch.from_numpy(halves(2)), torch.from_numpy(np.ascontiguousarray(m, dtype=np.uint8).reshape(rows, -1)))
