"""The packed GEMM's instruction sets give the same bits: the 512-bit tiles (two tiles of eight columns
per vector, up to eight rows a pass) against processes capped at 256-bit VNNI and at AVX2, for every
weight format, one to nine rows, 16 and 33 (a pass of eight rows and its rest), an odd last tile and a
partial one; and each row of a call the same as that row alone."""

from __future__ import annotations

import pytest
import torch

from stepahead.kernels import cpu_build, cpu_packed
from stepahead.models.quant import kquant_tiles
from tests.kernels.test_cpu_packed_gemm import _args, _q8_0, products_capped_at
from tests.kernels.test_cpu_packed_gemm import _weight as _q4
from tests.kernels.test_kquant_gemm import _q5
from tests.kernels.test_kquant_gemm import _weight as _kquant

pytestmark = pytest.mark.skipif(not cpu_build.machine_can_build(), reason="needs an AVX2 CPU and a C++ compiler")

ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 33)
# 37 columns: five tiles, two blocks of two and an odd last tile of five columns; 48: three whole blocks.
COLUMNS = (37, 48)
IN_FEATURES = 512  # two k-quant super-blocks


def _tiles(format_name: str, n: int) -> torch.Tensor:
    if format_name == "Q4":
        return _args(_q4(n, IN_FEATURES))[0]
    if format_name == "Q8_0":
        q8 = _q8_0(n, IN_FEATURES)
        return cpu_packed.tile_q8(q8.q, q8.scales)
    if format_name in ("Q5_0", "Q5_1"):
        _, q5 = _q5(format_name, n, IN_FEATURES)
        return cpu_packed.tile_q5(q5.q, q5.scales, q5.mins)
    return kquant_tiles.tile_kquant(_kquant(format_name, n, IN_FEATURES)[1])


FORMATS = ("Q4", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


@pytest.fixture(scope="module")
def cases() -> list:
    torch.manual_seed(0)
    out = []
    for format_name in FORMATS:
        for n in COLUMNS:
            tiles = _tiles(format_name, n)
            for rows in ROWS:
                x = torch.randn(rows, IN_FEATURES) * 3
                x[rows - 1, 32:64] = 0  # an all-zero group in the last row: scale 0
                out.append((x, tiles, n))
    return out


@pytest.mark.parametrize("cap", ["avx2", "avx512_vnni"])
def test_every_instruction_set_multiplies_to_the_same_bits(cap, cases, tmp_path):
    isa = cpu_packed.instruction_set()
    if isa == "avx2" or (cap == "avx512_vnni" and isa not in ("avx512", "amx_int8")):
        pytest.skip(f"this process multiplies with {isa}: nothing wider than {cap} to compare")
    for (x, tiles, n), theirs in zip(cases, products_capped_at(cap, cases, tmp_path), strict=True):
        assert torch.equal(cpu_packed.packed_gemm(x, tiles, n), theirs), (tiles.shape, x.shape)


def test_a_row_is_the_same_alone_and_at_any_position_of_a_call(cases):
    for x, tiles, n in cases:
        if x.shape[0] not in (5, 9, 33):
            continue
        y = cpu_packed.packed_gemm(x, tiles, n)
        for i in range(x.shape[0]):
            assert torch.equal(cpu_packed.packed_gemm(x[i:i + 1], tiles, n)[0], y[i]), (tiles.shape, x.shape, i)
