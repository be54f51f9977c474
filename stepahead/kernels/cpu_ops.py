"""The model's non-GEMM steps as single CPU kernels (rms_norm.cpp, rope.cpp, silu_mul.cpp,
paged_decode.cpp; built by kernels/cpu_build.py), for the packed-weight path where a one-token step is
otherwise dominated by dispatching torch's small operators. Each computes every row on its own, in a
fixed order."""

from __future__ import annotations

import functools

import torch

from stepahead.kernels import cpu_build


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's F.rms_norm over the last dimension in one call, bitwise where rms_norm_is_torchs(dim)."""
    flat = x.reshape(-1, x.shape[-1])
    return _op("rms_norm")(flat if flat.is_contiguous() else flat.contiguous(), weight, eps).view(x.shape)


# torch splits a single row's sum between threads from this many elements (ATen's GRAIN_SIZE)
TORCH_SERIAL_SUM_LIMIT = 32768


@functools.cache
def rms_norm_is_torchs(dim: int) -> bool:
    """Whether rms_norm gives torch's F.rms_norm bits here for rows of `dim`, checked on the spot on
    rows at three scales: its sum follows torch's 8-lane AVX2 order, which the AVX2 build of torch
    runs and, as measured, so does the AVX-512 one on Zen 4, but another build or CPU may not. A row of
    TORCH_SERIAL_SUM_LIMIT or more may be split between torch's threads, so it is never taken."""
    if dim >= TORCH_SERIAL_SUM_LIMIT or not cpu_build.available():
        return False
    gen = torch.Generator().manual_seed(dim)
    weight = torch.randn(dim, generator=gen)
    for scale in (1e-3, 1.0, 30.0):  # a last-bit difference in the sum shows in about half the rows
        x = torch.randn(64, dim, generator=gen) * scale
        if not torch.equal(rms_norm(x, weight, 1e-6), torch.nn.functional.rms_norm(x, (dim,), weight, 1e-6)):
            return False
    return True


def rotary_embedding_(x: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate x [tokens, heads, head_dim] (unit stride within a head) in place by each token's
    cos_sin [tokens, 2, rotary_dim] rows, rotate-half convention: the first rotary_dim features of each
    head rotate, the rest stay."""
    _op("rotary_embedding")(x, cos_sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 * features] (gate first, then up): [..., features], each value
    a function of its own gate and up alone (a vectorized e^x, not torch's)."""
    flat = gate_up.reshape(-1, gate_up.shape[-1])
    return _op("silu_mul")(flat).view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def round_to_bf16_(x: torch.Tensor) -> None:
    """x's values (float32, contiguous) rounded to bfloat16 values in place: x.to(bfloat16).float()
    for every finite value, in one pass."""
    _op("round_to_bf16_")(x)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, out: torch.Tensor, window: int | None = None,
                           softcap: float | None = None) -> None:
    """Attention of one new token per row over its seq_lens[row] keys in the head-major paged cache
    ([kv_heads, blocks, block_size, head_dim]), read through block_table [rows, width]; q [rows, heads,
    head_dim] (any row and head strides), written to out (contiguous, shaped like q). window: only the
    last `window` keys of each row (the blocks before them are never read); softcap: scores become
    softcap * tanh(score / softcap)."""
    _op("paged_decode_attention")(q, k_cache, v_cache, block_table, seq_lens, scale, out, window or 0,
                                  softcap or 0.0)


def attention_instruction_set() -> str:
    """What paged_decode_attention computes on in this process: "avx512" (16-float vectors, on a CPU
    with AVX-512, for heads of a multiple of 64 floats, where STEPAHEAD_CPU_ATTENTION=avx512 asks for
    them) or "avx2" (the default: its bits are the same on every x86 machine). Decided at the first call
    for the whole process; STEPAHEAD_MAX_CPU_ISA=avx2 or avx512_vnni (the packed GEMM's cap at 256-bit
    vectors), set before it, keeps "avx2"."""
    return str(_op("paged_decode_isa")())


def write_kv_rows(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """The new tokens' k and v [tokens, kv_heads, head_dim] (float32, unit stride within a head) into
    16-bit paged caches at slot_mapping [tokens] (int64), rounded as torch converts, and k and v rewritten
    in place with the values the caches hold; a RuntimeError for a value beyond float16's range."""
    _op("write_kv_rows")(k, v, k_cache, v_cache, slot_mapping)


@functools.cache
def _op(name: str):
    return cpu_build.op(name)
