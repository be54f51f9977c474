"""The AVX2 4-bit and 8-bit GEMMs (packed_gemm.cpp; built by kernels/cpu_build.py).

torch's own weight-only int4 kernel multiplies bf16 activations with weights dequantized in floating
point; this one keeps GGUF's blocks (in tiles of four columns, tile_q4 / tile_q8: a thread reads its
columns as one stream, which made a one-token step 1.45x faster), quantizes the activations to 16-bit
integers per group of 32 and multiplies with exact integer dot products (llama.cpp's Q4 x Q8 scheme
with twice the activation bits). Over the built-in model's 120 projections at 32 rows it took 115-130 ms against 161-194 ms
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


def kernel_for(group_size: int) -> str:
    """Which kernel a packed linear with this group size runs here: "stepahead" (GGUF's groups of 32,
    kernels built) or "torch"."""
    return "stepahead" if group_size == GROUP and available() else "torch"


def int4_gemm(x: torch.Tensor, tiles: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 times the [N, K] weight  codes * scales + mins  (tile_q4's layout, mins [N, K / 32]):
    [M, N] float32, with x and the result rounded to bf16 values."""
    return _op("int4_gemm")(x, tiles, mins)


def int8_gemm(x: torch.Tensor, tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32 times the [N, K] weight  codes * scales  (tile_q8's layout, N = out_features):
    [M, N] float32, with x and the result rounded to bf16 values."""
    return _op("int8_gemm")(x, tiles, out_features)


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


TILE = 4  # columns per tile of the kernels' layout


def tile_q4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """pack_codes' bytes [N, K / 2] and their scales [N, K / 32] in the kernels' layout (packed_gemm.h):
    per tile of four columns and group of 32 inputs, the four columns' 16 code bytes then their four
    float32 scales. [ceil(N / 4), K / 32, 80] uint8."""
    return _tiles(codes.view(codes.shape[0], -1, GROUP // 2), scales)


def tile_q8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] and their scales [N, K / 32] (GGUF's Q8_0) in the kernels' layout: per tile of
    four columns and group, the four columns' 32 codes then their four scales. [ceil(N / 4), K / 32, 144]."""
    return _tiles(q.to(torch.int8).contiguous().view(torch.uint8).view(q.shape[0], -1, GROUP), scales)


def untile(tiles: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tile_q4 or tile_q8 undone: (the code bytes [N, K / 2 or K] uint8, the scales [N, K / 32])."""
    count, groups, record = tiles.shape
    width = (record - 4 * TILE) // TILE
    codes = tiles[..., : TILE * width].reshape(count, groups, TILE, width).transpose(1, 2)
    scales = tiles[..., TILE * width:].contiguous().view(torch.float32).transpose(1, 2)
    return (codes.reshape(count * TILE, groups * width)[:out_features],
            scales.reshape(count * TILE, groups)[:out_features])


def _tiles(code_groups: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, groups, width = code_groups.shape
    pad = -n % TILE
    if pad:
        code_groups = torch.cat((code_groups, code_groups.new_zeros(pad, groups, width)))
        scales = torch.cat((scales, scales.new_zeros(pad, groups)))
    count = (n + pad) // TILE
    codes = code_groups.reshape(count, TILE, groups, width).transpose(1, 2).reshape(count, groups, TILE * width)
    scale_bytes = scales.float().reshape(count, TILE, groups).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat((codes, scale_bytes), dim=-1).contiguous()
