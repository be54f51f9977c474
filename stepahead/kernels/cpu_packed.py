"""The packed GEMM over 4-, 5- and 8-bit codes and the k-quants (packed_gemm.cpp; built by
kernels/cpu_build.py; the k-quants' layout in models/quant/kquant_tiles.py): AVX2, with AVX-512
VNNI's vpdpwssd for the dot products where the CPU has it, and AMX-INT8 tiles for whole blocks of 16
rows where it has those (kernels/amx_gemm.cpp; the same bits each way, see instruction_set).

torch's own weight-only int4 kernel multiplies bf16 activations with weights dequantized in floating
point; this one keeps GGUF's codes and scales per group of 32 (in tiles of eight columns, tile_q4 /
tile_q8: a thread reads its columns as one stream, and a vector holds one pair of inputs for eight
columns), quantizes the activations to 16-bit integers per group of 32 and multiplies with exact
integer dot products (llama.cpp's Q4 x Q8 scheme with twice the activation bits). Its logits are
closer to the fp32 model's (GGUF's float16 scales kept exactly instead of rounded to bf16). A row's
result does not depend on its batch (see the source). The 8-bit one multiplies GGUF's Q8_0 codes
with their per-group scales (torch's int8 kernel takes one scale per row, so Q8_0 would be
requantized). Where the kernels are not built, the packed linears use torch's kernels."""

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


def instruction_set() -> str:
    """What the kernels multiply with in this process: "amx_int8" (whole blocks of 16 rows on AMX-INT8
    tiles, the other rows as "avx512"; where the CPU has AMX and Linux grants the tile state), "avx512"
    (two tiles of eight columns per 512-bit vector, vpdpwssd, up to eight rows a pass; a CPU with
    AVX-512 F, BW, VL and VNNI), "avx512_vnni" (vpdpwssd on 256-bit vectors) or "avx2" (vpmaddwd then
    vpaddd); the same bits in every case. STEPAHEAD_MAX_CPU_ISA=avx2, avx512_vnni or avx512, set before
    the first call, caps it (A/B runs, tests)."""
    return _op("packed_gemm_isa")()


def int4_gemm(x: torch.Tensor, tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32 times the [N, K] weight  codes * scales + mins  (tile_q4's layout,
    N = out_features): [M, N] float32, with x and the result rounded to bf16 values."""
    return packed_gemm(x, tiles, out_features)


def int8_gemm(x: torch.Tensor, tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32 times the [N, K] weight  codes * scales  (tile_q8's layout, N = out_features):
    [M, N] float32, with x and the result rounded to bf16 values."""
    return packed_gemm(x, tiles, out_features)


def packed_gemm(x: torch.Tensor, tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32 times a packed [N, K] weight in any of the kernels' layouts (tile_q4, tile_q8,
    models/quant/kquant_tiles.py's tile_kquant; the record size names the format): [M, N] float32, with x and
    the result rounded to bf16 values."""
    return _op("packed_gemm")(x, tiles, out_features)


@functools.cache
def _op(name: str):
    """The kernel, looked up once (a projection calls it every step)."""
    return cpu_build.op(name)


TILE = 8  # columns per tile of the kernels' layout
PAIRS = GROUP // 2  # pairs of inputs per group: the kernels multiply a pair for eight columns at once
Q4_RECORD = TILE * GROUP // 2 + 2 * TILE * 2  # bytes per tile and group: nibbles, float16 scales and mins
Q5_RECORD = Q4_RECORD + 32  # and the fifth bits


def tile_q4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [N, K], their scales and mins [N, K / 32] in the kernels' layout (packed_gemm.h): per
    tile of eight columns and group of 32 inputs, 128 bytes of nibbles, then the eight float16 scales
    and the eight float16 mins. [ceil(N / 8), K / 32, 160] uint8."""
    slots = _slots(q.to(torch.uint8), 4)  # [..., lane, 4 nibbles]: two bytes per int16 lane
    return _records(slots[..., 0::2] | (slots[..., 1::2] << 4), scales, mins)


def tile_q5(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Codes 0..31 [N, K] (GGUF's Q5_0 as q with min -16 d, Q5_1), their scales and mins [N, K / 32]: per
    tile and group tile_q4's nibbles of the low four bits, then one 32-byte chunk of fifth bits (bit b of
    int16 lane 2 * column + e: input 2b + e), then the float16 scales and mins. [ceil(N / 8), K / 32, 192]."""
    codes = q.to(torch.uint8)
    slots = _slots(codes & 0x0F, 4)
    nibbles = (slots[..., 0::2] | (slots[..., 1::2] << 4)).reshape(*slots.shape[:2], -1)
    return _records(torch.cat((nibbles, high_bits(codes, 1, 1)), dim=-1), scales, mins)


def high_bits(codes: torch.Tensor, bits: int, chunks: int) -> torch.Tensor:
    """The bits above the nibble of codes [N, K] as `chunks` 32-byte chunks per tile and group of 32:
    chunk k's int16 lane 2 * column + e holds, at bits * b', the high bits of input 2 (16 / chunks * k +
    b') + e. [ceil(N / 8), K / 32, 32 * chunks] uint8."""
    high = _pad_to_tiles((codes >> 4).to(torch.int32))
    count, groups = high.shape[0] // TILE, high.shape[1] // GROUP
    # [tile, column, group, chunk, b', e] -> [tile, group, chunk, column, e, b']
    high = high.reshape(count, TILE, groups, chunks, PAIRS // chunks, 2).permute(0, 2, 3, 1, 5, 4)
    lanes = (high << (bits * torch.arange(PAIRS // chunks, dtype=torch.int32))).sum(-1)
    return torch.stack((lanes & 0xFF, lanes >> 8), dim=-1).to(torch.uint8).reshape(count, groups, -1)


def unpack_high_bits(high: torch.Tensor, bits: int, chunks: int) -> torch.Tensor:
    """high_bits undone: [tile, group, 32 * chunks] bytes -> the high bits [tile * 8, group * 32] (int32)."""
    count, groups = high.shape[:2]
    lane_bytes = high.reshape(count, groups, chunks, TILE, 2, 2)
    lanes = lane_bytes[..., 0].to(torch.int32) | (lane_bytes[..., 1].to(torch.int32) << 8)
    values = (lanes.unsqueeze(-1) >> (bits * torch.arange(PAIRS // chunks, dtype=torch.int32))) & ((1 << bits) - 1)
    return values.permute(0, 3, 1, 2, 5, 4).reshape(count * TILE, groups * GROUP)


def tile_q8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] and their scales [N, K / 32] (GGUF's Q8_0) in the kernels' layout: per tile of
    eight columns and group, 256 bytes of codes then the eight float16 scales. [ceil(N / 8), K / 32, 272]."""
    return _records(_slots(q.to(torch.int8).view(torch.uint8), 2), scales)


def untile(tiles: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """tile_q4, tile_q5 or tile_q8 undone: the codes [N, K] (uint8 0..15 or 0..31, or int8), the scales
    [N, K / 32] and the mins [N, K / 32] (None for 8-bit codes), float32."""
    count, groups, record = tiles.shape
    with_mins = record in (Q4_RECORD, Q5_RECORD)
    nibble_bytes = TILE * GROUP // (2 if with_mins else 1)
    code_bytes = tiles[..., :nibble_bytes]
    if with_mins:  # nibbles: low then high of each byte
        slot_count = 4
        b = code_bytes.reshape(count, groups, -1, TILE, 2, 2)
        slots = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)
    else:
        slot_count = 2
        slots = code_bytes.reshape(count, groups, -1, TILE, 2, 2).view(torch.int8)
    # [tile, group, chunk, column, e, slot] -> [tile, column, group, chunk, slot, e]:
    # input 2 * (slot_count * chunk + slot) + e
    codes = slots.reshape(count, groups, PAIRS // slot_count, TILE, 2, slot_count).permute(0, 3, 1, 2, 5, 4)
    codes = codes.reshape(count * TILE, groups * GROUP)
    if record == Q5_RECORD:
        high = tiles[..., nibble_bytes:nibble_bytes + 32]
        codes = (codes.to(torch.int32) | (unpack_high_bits(high, 1, 1) << 4)).to(torch.uint8)
        nibble_bytes += 32
    halves = tiles[..., nibble_bytes:].contiguous().view(torch.float16).float()
    halves = halves.reshape(count, groups, -1, TILE).permute(2, 0, 3, 1).reshape(-1, count * TILE, groups)
    return codes[:out_features], halves[0][:out_features], halves[1][:out_features] if with_mins else None


def _slots(q: torch.Tensor, slot_count: int) -> torch.Tensor:
    """[N, K] codes as [tile, group, chunk, column, e, slot]: chunk j's int16 lane 2 * column + e holds,
    in its slots, the column's codes at inputs 2 * (slot_count * j + slot) + e; N padded to whole tiles."""
    q = _pad_to_tiles(q)
    count, groups = q.shape[0] // TILE, q.shape[1] // GROUP
    return q.reshape(count, TILE, groups, PAIRS // slot_count, slot_count, 2).permute(0, 2, 3, 1, 5, 4)


def _records(code_bytes: torch.Tensor, *per_group: torch.Tensor) -> torch.Tensor:
    """Code bytes [tile, group, ...] and the scales (and mins) [N, groups] as records [tile, group, codes,
    then each per-group tensor's eight float16 values]. GGUF stores scales and mins as float16; a value
    float16 cannot hold exactly is refused, not rounded."""
    count, groups = code_bytes.shape[:2]
    parts = [code_bytes.reshape(count, groups, -1)]
    for values in per_group:
        halves = values.to(torch.float16)
        if not torch.equal(halves.float(), values.float()):
            raise ValueError("the kernels keep scales and mins as float16 (GGUF's format); these values "
                             "are not float16 values")
        halves = _pad_to_tiles(halves).reshape(count, TILE, groups).transpose(1, 2)
        parts.append(halves.contiguous().view(torch.uint8))
    return torch.cat(parts, dim=-1).contiguous()


def _pad_to_tiles(t: torch.Tensor) -> torch.Tensor:
    """t [N, ...] with zero rows appended up to a multiple of TILE."""
    pad = -t.shape[0] % TILE
    return torch.cat((t, t.new_zeros(pad, *t.shape[1:]))) if pad else t
