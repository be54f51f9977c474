"""Rotary position embeddings: each position's cos/sin rows with a checkpoint's rope scaling applied,
and the rotation itself (rotate-half convention, as in HF checkpoints), over the whole head or its
first rotary_dim features (partial_rotary_factor < 1, as Phi-4-mini).

Every scaling type becomes one table of rows computed once at load, as vLLM builds it; the types
transformers recomputes per forward length (dynamic, longrope) pick once instead, and the comments
at those branches say where that differs from transformers.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


class RopeArgs(Protocol):
    """What rope needs of a family's arguments."""

    head_dim: int
    rope_theta: float
    rope_scaling: dict | None
    partial_rotary_factor: float
    max_position_embeddings: int


def rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return "longrope" if kind == "su" else kind  # Phi-3's first checkpoints call longrope "su"


def check_rope_type(scaling: dict | None) -> None:
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def check_rope(args: RopeArgs) -> None:
    """A ValueError naming what the checkpoint's rope settings lack or hold wrong, before anything runs."""
    check_rope_type(args.rope_scaling)
    try:
        rope_inv_freq(args, args.max_position_embeddings)
    except KeyError as e:
        raise ValueError(f"rope_scaling of type {rope_type(args.rope_scaling)!r} lacks the field {e.args[0]!r}") from e


def rotary_dim(args: RopeArgs) -> int:
    """How many leading features of each head rotate (the rest pass through)."""
    dim = int(args.head_dim * args.partial_rotary_factor)
    if not 0 < dim <= args.head_dim or dim % 2:
        raise ValueError(f"partial_rotary_factor={args.partial_rotary_factor} gives {dim} rotary features of "
                         f"head_dim={args.head_dim}; they must be an even number in (0, head_dim]")
    return dim


def _original_max_positions(args: RopeArgs) -> int:
    s = args.rope_scaling or {}
    return int(s.get("original_max_position_embeddings") or args.max_position_embeddings)


def max_context(args: RopeArgs) -> int:
    """The longest context the scaled table covers, derived as vLLM derives it: yarn stretches the
    original context by its factor, dynamic stretches max_position_embeddings by it; the other types
    (linear included, whose checkpoints state the stretched length already) keep max_position_embeddings."""
    kind = rope_type(args.rope_scaling)
    s = args.rope_scaling or {}
    if kind == "yarn":
        return int(_original_max_positions(args) * float(s["factor"]))
    if kind == "dynamic":
        return int(args.max_position_embeddings * float(s["factor"]))
    return args.max_position_embeddings


def _yarn_inv_freq(args: RopeArgs, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between (by the
    number of rotations over the original context), and the attention factor on cos/sin."""
    s = args.rope_scaling or {}
    factor, base, original = float(s["factor"]), args.rope_theta, _original_max_positions(args)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:  # the feature index that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-feature ramp still needs a width
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    base_inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    inv = base_inv / factor * ramp + base_inv * (1 - ramp)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return inv, float(attention)


def _longrope_inv_freq(args: RopeArgs, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3/4): per-feature rescale factors, short or long, and the attention factor."""
    s = args.rope_scaling or {}
    original = _original_max_positions(args)
    # As vLLM: the long factors for every position when the engine may run past the original context
    # (max_model_len > original_max_position_embeddings), else the short ones, chosen once. transformers
    # chooses per forward (long once that forward's longest sequence exceeds the original context), so
    # a sequence crossing it mid-generation keeps keys cached under the short factors there. The two
    # agree when max_model_len stays within the original context, and when every prompt already
    # exceeds it.
    for name in ("short_factor", "long_factor"):
        if len(s[name]) != dim // 2:
            raise ValueError(f"rope_scaling {name} must hold {dim // 2} values (rotary dim {dim} / 2), "
                             f"got {len(s[name])}")
    factors = s["long_factor"] if max_positions > original else s["short_factor"]
    inv = 1.0 / (torch.tensor(factors, dtype=torch.float64)
                 * args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    attention = s.get("attention_factor")
    if attention is None:
        scale = float(s.get("factor") or args.max_position_embeddings / original)
        attention = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))
    return inv, float(attention)


def rope_inv_freq(args: RopeArgs, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies with the scaling applied, in float64; the factor cos and sin are scaled by)
    for an engine that runs positions below max_positions."""
    check_rope_type(args.rope_scaling)
    d = rotary_dim(args)
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
    elif kind == "yarn":
        return _yarn_inv_freq(args, d)
    elif kind == "longrope":
        return _longrope_inv_freq(args, d, max_positions)
    # kind == "dynamic": vLLM's dynamic NTK table stretches the base by (L / max_pos - (factor - 1)) at
    # L = max_pos * factor, which is 1: the unscaled frequencies at every position. transformers
    # recomputes the base per forward from that forward's length L, growing it once L exceeds
    # max_position_embeddings; within max_position_embeddings both are the unscaled rope.
    return inv, 1.0


def rope_cos_sin(args: RopeArgs, max_positions: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[max_positions, 2, rotary_dim]: each position's cos and sin rows (both halves), scaled."""
    inv, attention = rope_inv_freq(args, max_positions)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (torch.stack((emb.cos(), emb.sin()), dim=1) * attention).to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; cos/sin [T, 1, rotary_dim] (rotate-half convention, as in HF checkpoints). The
    features past rotary_dim pass through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
