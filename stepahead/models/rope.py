"""Rotary position embeddings: the inverse frequencies with a checkpoint's rope scaling applied, and
the rotation itself (rotate-half convention, as in HF checkpoints)."""

from __future__ import annotations

import math
from typing import Protocol

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class RopeArgs(Protocol):
    """What rope needs of a family's arguments."""

    head_dim: int
    rope_theta: float
    rope_scaling: dict | None


def rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"


def check_rope_type(scaling: dict | None) -> None:
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def rope_inv_freq(args: RopeArgs) -> torch.Tensor:
    """Inverse frequencies with the family's rope scaling applied (float64 for exactness)."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).double() / d))
    kind = rope_type(args.rope_scaling)
    s = args.rope_scaling or {}
    if kind == "linear":
        inv = inv / float(s["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_len = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv = torch.where(medium, smoothed, scaled)
    else:
        check_rope_type(args.rope_scaling)
    return inv


def rope_table(args: RopeArgs, max_positions: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[max_positions, 2, head_dim]: each position's cos and sin rows (computed in float64)."""
    pos = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(pos, rope_inv_freq(args))
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((emb.cos(), emb.sin()), dim=1).to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; cos/sin [T, 1, hd] (rotate-half convention, as in HF checkpoints)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
