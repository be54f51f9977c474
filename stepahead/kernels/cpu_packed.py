"""The AVX2 4-bit and 8-bit GEMMs (packed_gemm.cpp; built by kernels/cpu_build.py).

torch's own weight-only int4 kernel multiplies bf16 activations with weights dequantized in floating
point; this one keeps GGUF's block layout, quantizes the activations to 16-bit integers per group of
32 and multiplies with exact integer dot products (llama.cpp's Q4 x Q8 scheme with twice the activation
bits). Over the built-in model's 120 projections at 32 rows it took 115-130 ms against 161-194 ms
(three runs); at one row it is within the noise of torch's (14-21 against 18-19 ms). Its logits are
closer to the fp32 model's (fp32 scales instead of bf16 ones). A row's result does not depend on its
batch (see the source). The 8-bit one multiplies GGUF's Q8_0 codes with their per-group scales
(torch's int8 kernel takes one scale per row, so Q8_0 would be requantized). Where the kernels are
not built, the packed linears use torch's kernels."""

from __future__ import annotations

import functools

import torch

from stepahead.kernels import cpu_build

GROUP = 32  # inputs per scale and offset, GGUF's block


def available() -> bool:
    """Whether the kernel is built and loaded in this process (kernels/cpu_build.py)."""
    return cpu_build.available()


def int4_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 times the [N, K] weight  codes * scales + mins  (GGUF block layout): [M, N] float32,
    with x and the result rounded to bf16 values."""
    return _op("int4_gemm")(x, codes, scales, mins)


def int8_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 times the [N, K] weight  codes * scales  (int8 codes, a scale per group of 32):
    [M, N] float32, with x and the result rounded to bf16 values."""
    return _op("int8_gemm")(x, codes, scales)


@functools.cache
def _op(name: str):
    """The kernel, looked up once (a projection calls it every step)."""
    return cpu_build.op(name)


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 in GGUF's block layout: [N, K / 2] bytes, byte j of a group of 32 holding
    element j in its low nibble and element j + 16 in its high nibble."""
    groups = q.to(torch.uint8).view(q.shape[0], -1, GROUP)
    return (groups[..., : GROUP // 2] | (groups[..., GROUP // 2 :] << 4)).reshape(q.shape[0], -1).contiguous()


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """pack_codes undone: [N, K] uint8 codes."""
    halves = codes.view(codes.shape[0], -1, GROUP // 2)
    return torch.cat((halves & 0x0F, halves >> 4), dim=-1).reshape(codes.shape[0], -1)
