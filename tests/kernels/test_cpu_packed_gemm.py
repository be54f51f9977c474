"""stepahead's 4-bit and 8-bit kernels (kernels/packed_gemm.cpp), built on this machine: their arithmetic
against the same arithmetic in float64, a row's result in any batch, the AVX2 and VNNI paths' bits, and
the packed linear's choice of kernel."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from stepahead.kernels import cpu_build, cpu_packed
from stepahead.models.quant.quant_weights import GroupQuantWeight, quantize_int4, quantize_int8_rows
from stepahead.models.quant.quantized_linear import Int4Linear, Int8Linear

# Where the machine can build the kernel it must build: a failed build fails these tests, not skips them.
pytestmark = pytest.mark.skipif(not cpu_build.machine_can_build(), reason="needs an AVX2 CPU and a C++ compiler")


def _weight(out_features, in_features, seed=0):
    torch.manual_seed(seed)
    return quantize_int4(torch.randn(out_features, in_features))


def _reference(x, weight):
    """The kernel's arithmetic in float64: x rounded to bfloat16 and quantized per group of 32 to 16-bit
    codes, exact integer dot products with the weight codes, scaled, then the sum rounded to bfloat16."""
    x = x.bfloat16().double().numpy()
    rows, in_features = x.shape
    groups = x.reshape(rows, -1, 32)
    amax = np.abs(groups).max(-1, keepdims=True).astype(np.float32)
    dx = (amax / np.float32(32767)).astype(np.float64)
    inv = np.where(amax > 0, np.float32(32767) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    qx = np.rint(groups.astype(np.float32) * inv).astype(np.int64)
    q = weight.q.numpy().astype(np.int64).reshape(weight.q.shape[0], -1, 32)
    dots = np.einsum("rgk,ngk->rng", qx, q)  # exact integers
    y = (dots * weight.scales.double().numpy()[None] * dx.transpose(0, 2, 1)).sum(-1)
    if weight.mins is not None:  # 4-bit codes' offsets; Q8_0 has none
        y += (weight.mins.double().numpy()[None] * (dx[..., 0] * qx.sum(-1))[:, None, :]).sum(-1)
    return torch.from_numpy(y).float().bfloat16().float()


def _args(weight):
    return cpu_packed.tile_q4(weight.q, weight.scales, weight.mins), weight.q.shape[0]


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 16, 32), (3, 37, 64), (5, 64, 96), (13, 50, 576),
                                                           (32, 96, 1536)])
def test_kernel_computes_the_quantized_product(rows, out_features, in_features):
    weight = _weight(out_features, in_features)
    x = torch.randn(rows, in_features) * 3
    if in_features > 32:
        x[0, :32] = 0  # an all-zero group: scale 0, no division by zero
    y = cpu_packed.int4_gemm(x, *_args(weight))
    ref = _reference(x, weight)
    # Up to one bfloat16 step where float32 summation lands on the other side of a rounding boundary.
    step = ref.abs().clamp(min=1e-30) * 2.0 ** -7
    assert bool(((y - ref).abs() <= step).all())
    # and close to the exact product with the dequantized weight
    exact = x.double() @ weight.dequantize().double().t()
    assert float((y - exact).abs().max() / exact.abs().max()) < 1e-2


def test_a_non_finite_activation_makes_its_row_nan_and_no_other():
    weight = _weight(24, 64)
    x = torch.randn(3, 64)
    x[1, 40] = float("nan")
    x[2, 3] = float("inf")
    y = cpu_packed.int4_gemm(x, *_args(weight))
    assert bool(y[1:].isnan().all()) and bool(y[0].isfinite().all())


@pytest.mark.parametrize("out_features", [8, 37])  # 37: the last tile padded
def test_tiles_hold_the_codes_and_scales_and_come_apart_again(out_features):
    weight, q8 = _weight(out_features, 96), _q8_0(out_features, 96)
    tiles = cpu_packed.tile_q4(weight.q, weight.scales, weight.mins)
    assert tiles.shape == ((out_features + 7) // 8, 3, 8 * 16 + 16 + 16)
    # group 1, chunk 2: int16 lane 2 * 3 + 1 (column 3, odd input) holds inputs 2 * (4 * 2 + slot) + 1
    lane = int(tiles[0, 1, 64 + 14]) | int(tiles[0, 1, 64 + 15]) << 8
    assert [(lane >> 4 * slot) & 15 for slot in range(4)] == [int(weight.q[3, 32 + 2 * (8 + s) + 1]) for s in range(4)]
    # then column 1's float16 scale and min of group 1
    assert tiles[0, 1, 128 + 2:128 + 4].view(torch.float16).item() == weight.scales[1, 1].item()
    assert tiles[0, 1, 144 + 2:144 + 4].view(torch.float16).item() == weight.mins[1, 1].item()
    codes, scales, mins = cpu_packed.untile(tiles, out_features)
    assert codes.equal(weight.q.to(torch.uint8)) and scales.equal(weight.scales) and mins.equal(weight.mins)
    tiles = cpu_packed.tile_q8(q8.q, q8.scales)
    assert tiles.shape == ((out_features + 7) // 8, 3, 8 * 32 + 16)
    # group 2, chunk 5: lane 2 * 6 (column 6, even input); low byte input 2 * (2 * 5), high byte the next pair's
    assert tiles[0, 2, 160 + 24:160 + 26].view(torch.int8).tolist() == [int(q8.q[6, 64 + 20]), int(q8.q[6, 64 + 22])]
    codes, scales, mins = cpu_packed.untile(tiles, out_features)
    assert codes.equal(q8.q) and scales.equal(q8.scales) and mins is None


def test_tiles_refuse_scales_float16_cannot_hold():
    """The records keep GGUF's float16 scales and mins; a float32 value would be rounded, silently."""
    weight = _weight(16, 64)
    with pytest.raises(ValueError, match="float16"):
        cpu_packed.tile_q4(weight.q, weight.scales * (1 + 2.0 ** -20), weight.mins)
    with pytest.raises(ValueError, match="float16"):
        cpu_packed.tile_q8(weight.q.to(torch.int8), weight.scales * (1 + 2.0 ** -20))


def test_a_row_is_computed_the_same_at_any_position_in_any_batch():
    weight = _weight(70, 192)
    args = _args(weight)
    x = torch.randn(64, 192)
    alone = [cpu_packed.int4_gemm(x[i:i + 1], *args) for i in range(64)]
    for rows in range(1, 65):
        batch = cpu_packed.int4_gemm(x[:rows], *args)
        assert all(torch.equal(batch[i], alone[i][0]) for i in range(rows)), rows


def test_rows_in_later_panels_are_computed_as_alone():
    """A long call goes in panels of rows (256 KB of 16-bit codes: 84 rows of 1,536 inputs), the last
    one partial: every row's result is still its result alone."""
    weight = _weight(24, 1536)
    args = _args(weight)
    x = torch.randn(175, 1536)
    batch = cpu_packed.int4_gemm(x, *args)
    for i in (0, 83, 84, 85, 167, 168, 174):
        assert torch.equal(batch[i], cpu_packed.int4_gemm(x[i:i + 1], *args)[0]), i


@pytest.mark.parametrize("threads", [1, 3])  # 3 on this 2-core machine: more threads than cores
def test_the_result_does_not_depend_on_the_number_of_threads(threads):
    """The column blocks go to whichever thread asks first (kernels/team.h): the same bits on any team."""
    weight, x = _weight(1000, 576), torch.randn(7, 576)
    default = cpu_packed.int4_gemm(x, *_args(weight))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(3):
            assert torch.equal(cpu_packed.int4_gemm(x, *_args(weight)), default)
    finally:
        torch.set_num_threads(before)


def test_packed_linear_uses_the_kernel_and_its_weight_is_the_codes_weight():
    weight = _weight(48, 128)
    layer = Int4Linear(weight, bias=torch.randn(48))
    assert layer.kernel == "stepahead" and "kernel=stepahead" in repr(layer)
    assert torch.equal(layer.dequantized_weight(), weight.dequantize())
    x = torch.randn(4, 128)
    assert torch.equal(layer(x), cpu_packed.int4_gemm(x, *_args(weight)) + layer.bias)
    odd_groups = quantize_int4(torch.randn(48, 128), group_size=64)
    assert Int4Linear(odd_groups).kernel == "torch"  # the kernel reads GGUF's blocks of 32 only


def test_the_kernel_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(cpu_build.DISABLE_ENV, "1")
    cpu_build._module.cache_clear()
    try:
        assert not cpu_packed.available()
        assert Int4Linear(_weight(32, 64)).kernel == "torch"
    finally:
        monkeypatch.delenv(cpu_build.DISABLE_ENV)
        cpu_build._module.cache_clear()
    assert cpu_packed.available()


def _q8_0(out_features, in_features, seed=0):
    """GGUF Q8_0's shape of weight: int8 codes (the full range) and a scale per group of 32."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=gen)
    scales = (torch.rand(out_features, in_features // 32, generator=gen) / 64).half().float()  # GGUF's float16
    return GroupQuantWeight(q, scales, None, 32, 8)


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 16, 32), (5, 37, 96), (32, 96, 576)])
def test_the_8bit_kernel_computes_the_q8_0_product_row_by_row(rows, out_features, in_features):
    weight = _q8_0(out_features, in_features)
    x = torch.randn(rows, in_features) * 3
    x[0, -32:] = 1000.0  # a group at the codes' extremes: a sum past 2^24 is rounded once, within a bf16 step
    tiles = cpu_packed.tile_q8(weight.q, weight.scales)
    y = cpu_packed.int8_gemm(x, tiles, out_features)
    ref = _reference(x, weight)
    assert bool(((y - ref).abs() <= ref.abs().clamp(min=1e-30) * 2.0 ** -7).all())
    for i in range(rows):
        assert torch.equal(cpu_packed.int8_gemm(x[i:i + 1], tiles, out_features)[0], y[i])


def test_int8_linear_runs_q8_0_on_the_kernel_and_per_row_codes_on_torchs():
    weight = _q8_0(48, 128)
    layer = Int8Linear(weight)
    assert layer.kernel == "stepahead" and "kernel=stepahead" in repr(layer)
    assert torch.equal(layer.dequantized_weight(), weight.dequantize())
    x = torch.randn(3, 128)
    assert torch.equal(layer(x), cpu_packed.int8_gemm(x, cpu_packed.tile_q8(weight.q, weight.scales), 48))
    assert Int8Linear(quantize_int8_rows(torch.randn(48, 128))).kernel == "torch"  # one scale per row


_CAPPED_RUN = """
import sys, torch
from stepahead.kernels import cpu_packed
cases = torch.load(sys.argv[1])
out = [cpu_packed.packed_gemm(x, tiles, n) for x, tiles, n in cases]
torch.save((cpu_packed.instruction_set(), out), sys.argv[2])
"""


def capped_env(cap: str) -> dict[str, str]:
    """This process's environment with the kernels capped at `cap` (STEPAHEAD_MAX_CPU_ISA)."""
    return {**os.environ, "STEPAHEAD_MAX_CPU_ISA": cap}


def products_capped_at(cap: str, cases: list, tmp_path) -> list[torch.Tensor]:
    """packed_gemm(x, tiles, n) for each case, in a process whose instruction set is capped at `cap`
    (STEPAHEAD_MAX_CPU_ISA: "avx2" or "avx512_vnni")."""
    torch.save(cases, tmp_path / "cases.pt")
    subprocess.run([sys.executable, "-c", _CAPPED_RUN, str(tmp_path / "cases.pt"), str(tmp_path / f"{cap}.pt")],
                   env=capped_env(cap), check=True, timeout=600)
    isa, products = torch.load(tmp_path / f"{cap}.pt")
    assert isa == cap
    return products


def products_capped_at_avx2(cases: list, tmp_path) -> list[torch.Tensor]:
    """packed_gemm(x, tiles, n) for each case, in a process capped at AVX2 (STEPAHEAD_MAX_CPU_ISA)."""
    return products_capped_at("avx2", cases, tmp_path)


def test_vnni_and_avx2_multiply_to_the_same_bits(tmp_path):
    """vpdpwssd here, vpmaddwd and vpaddd in a process capped at AVX2 (STEPAHEAD_MAX_CPU_ISA): every
    tile shape (one to four rows, one or two tiles, panels), both formats, the same bits."""
    if cpu_packed.instruction_set() == "avx2":
        pytest.skip("needs a CPU with AVX-512 VNNI, where the kernels multiply with vpdpwssd")
    q4, q8 = _weight(70, 576), _q8_0(70, 576)
    cases = []
    for rows in (1, 2, 3, 4, 5, 7, 9, 175):
        x = torch.randn(rows, 576) * 3
        cases.append((x, *_args(q4)))
        cases.append((x, cpu_packed.tile_q8(q8.q, q8.scales), 70))
    for (x, tiles, n), theirs in zip(cases, products_capped_at("avx2", cases, tmp_path), strict=True):
        assert torch.equal(cpu_packed.packed_gemm(x, tiles, n), theirs), (tiles.shape, x.shape)
