"""The k-quants (Q4_K, Q5_K, Q6_K) in the packed GEMM's layout (kernels/packed_gemm.h), and back.

Per tile of eight output columns and super-block of 256 inputs, one record: a header (the columns'
float16 d, Q4_K / Q5_K's float16 -dmin, the sub-block scales as bytes [sub-block][column], Q4_K /
Q5_K's mins likewise), then eight groups of 32 inputs, each Q4's 128 bytes of low nibbles
(kernels/cpu_packed.py's tile_q4 layout) and the codes' high bits: Q5_K one 32-byte chunk whose int16
lane 2c + e holds in bit b the fifth bit of column c's code at input 2b + e; Q6_K two chunks, bits
2 (b % 8) and 2 (b % 8) + 1 of chunk b // 8's lane the fifth and sixth. The factors stay as the file
holds them, so the record reads 4.625 (Q4_K), 5.625 (Q5_K) or 6.5625 (Q6_K) bits per weight.
"""

from __future__ import annotations

import torch

from stepahead.kernels.cpu_packed import (
    GROUP,
    PAIRS,
    TILE,
    _pad_to_tiles,
    _slots,
    high_bits,
    unpack_high_bits,
)
from stepahead.models.quant.kquant_weights import SUPER_BLOCK, KQuantWeight, sub_block

GROUPS = SUPER_BLOCK // GROUP  # groups of 32 per super-block
HIGH_BYTES = {"Q4_K": 0, "Q5_K": 32, "Q6_K": 64}  # per group and tile


def record_bytes(type_name: str) -> int:
    """Bytes of one record (a tile's super-block), as packed_gemm.h computes them."""
    header = 2 * TILE + (SUPER_BLOCK // sub_block(type_name)) * TILE
    if type_name != "Q6_K":
        header += 2 * TILE + GROUPS * TILE  # -dmin and the mins
    return header + GROUPS * (TILE * GROUP // 2 + HIGH_BYTES[type_name])


def tile_kquant(weight: KQuantWeight) -> torch.Tensor:
    """The weight's records: [ceil(N / 8), K / 256, record_bytes] uint8."""
    rows, cols = weight.shape
    supers = cols // SUPER_BLOCK
    count = -(-rows // TILE)

    def per_column(values: torch.Tensor) -> torch.Tensor:
        """[N, S * per_block] values as [tile, S, per_block, column] (the header's order)."""
        values = _pad_to_tiles(values)
        return values.reshape(count, TILE, supers, -1).permute(0, 2, 3, 1)

    def halves(values: torch.Tensor) -> torch.Tensor:
        return per_column(values.to(torch.float16)).contiguous().view(torch.uint8).reshape(count, supers, -1)

    def as_bytes(values: torch.Tensor) -> torch.Tensor:
        return per_column(values).contiguous().view(torch.uint8).reshape(count, supers, -1)

    header = [halves(weight.d)]
    if weight.dmin is not None and weight.mins is not None:
        header.append(halves(-weight.dmin))  # exact: a sign
    header.append(as_bytes(weight.scales))
    if weight.mins is not None:
        header.append(as_bytes(weight.mins))
    codes = weight.q.to(torch.uint8)
    slots = _slots(codes & 0x0F, 4)  # [tile, group, chunk, column, e, slot]
    groups = [(slots[..., 0::2] | (slots[..., 1::2] << 4)).reshape(count, supers * GROUPS, -1)]
    high_bytes = HIGH_BYTES[weight.type_name]
    if high_bytes:
        bits = 1 if weight.type_name == "Q5_K" else 2
        groups.append(high_bits(codes, bits, high_bytes // 32))
    group_bytes = torch.cat(groups, dim=-1).reshape(count, supers, -1)
    return torch.cat([*header, group_bytes], dim=-1).contiguous()


def untile_kquant(tiles: torch.Tensor, out_features: int, type_name: str) -> KQuantWeight:
    """tile_kquant undone."""
    count, supers, record = tiles.shape
    if record != record_bytes(type_name):
        raise ValueError(f"records of {record} bytes are not {type_name}'s ({record_bytes(type_name)})")
    subs = SUPER_BLOCK // sub_block(type_name)
    at = 0

    def take(nbytes: int) -> torch.Tensor:
        nonlocal at
        part = tiles[..., at:at + nbytes]
        at += nbytes
        return part.contiguous()

    def columns(values: torch.Tensor) -> torch.Tensor:
        """[tile, S, per_block, column] back to [N, S * per_block]."""
        per_block = values.shape[2]
        return values.permute(0, 3, 1, 2).reshape(count * TILE, supers * per_block)[:out_features]

    def halves() -> torch.Tensor:
        return columns(take(2 * TILE).view(torch.float16).reshape(count, supers, 1, TILE)).float()

    d = halves()
    dmin = -halves() if type_name != "Q6_K" else None
    scales = take(subs * TILE).reshape(count, supers, subs, TILE)
    scales = columns(scales.view(torch.int8) if type_name == "Q6_K" else scales)
    mins = columns(take(GROUPS * TILE).reshape(count, supers, GROUPS, TILE)) if type_name != "Q6_K" else None
    group_bytes = take(GROUPS * (TILE * GROUP // 2 + HIGH_BYTES[type_name])).reshape(count, supers * GROUPS, -1)
    nibble_bytes = group_bytes[..., :TILE * GROUP // 2].reshape(count, supers * GROUPS, PAIRS // 4, TILE, 2, 2)
    slots = torch.stack((nibble_bytes & 0x0F, nibble_bytes >> 4), dim=-1).flatten(-2)  # [.., chunk, col, e, slot]
    # [tile, group, chunk, column, e, slot] -> [tile, column, group, chunk, slot, e]: input 2 (4 chunk + slot) + e
    codes = slots.permute(0, 3, 1, 2, 5, 4).reshape(count * TILE, supers * SUPER_BLOCK).to(torch.int32)
    high_bytes = HIGH_BYTES[type_name]
    if high_bytes:
        bits = 1 if type_name == "Q5_K" else 2
        high = group_bytes[..., TILE * GROUP // 2:]
        codes = codes | (unpack_high_bits(high, bits, high_bytes // 32) << 4)
    return KQuantWeight(type_name, codes[:out_features].to(torch.uint8), d, scales, dmin, mins)
