"""The k-quants (Q4_K, Q5_K, Q6_K) and the 5-bit Q5_0 / Q5_1 on stepahead's packed kernel: GGUF blocks decoded as gguf dequantizes
them, the records' layout both ways, the product against gguf's own dequantization and against the
kernel's arithmetic in float64, a row's bits in any batch, and AVX2 and VNNI to the same bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stepahead.kernels import cpu_build, cpu_packed
from stepahead.models.quant import kquant_tiles
from stepahead.models.quant.kquant_weights import KQUANT_TYPES, decode_kquant_blocks, sub_block
from stepahead.models.quant.quant_weights import decode_gguf_blocks
from tests.kernels.test_cpu_packed_gemm import _reference as _group_reference
from tests.kernels.test_cpu_packed_gemm import products_capped_at
from tests.models.kquant_blocks import quantize_kquant, random_kquant_blocks

pytestmark = pytest.mark.skipif(not cpu_build.machine_can_build(), reason="needs an AVX2 CPU and a C++ compiler")

TYPES = list(KQUANT_TYPES)


def _gguf_dequantized(raw, type_name):
    import gguf
    import gguf.quants

    return torch.from_numpy(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, type_name)))


def _weight(type_name, rows, cols, seed=0):
    raw = random_kquant_blocks(rows, cols, type_name, seed)
    return raw, decode_kquant_blocks(raw, type_name, (rows, cols))


def _reference(x, weight):
    """The kernel's arithmetic in float64: x rounded to bfloat16 and quantized per group of 32 to 16-bit
    codes, exact integer dot products per sub-block with the codes, scaled by d * sc, the mins' term
    per group, the sum rounded to bfloat16."""
    x = x.bfloat16().double().numpy()
    rows, cols = x.shape
    groups = x.reshape(rows, -1, 32)
    amax = np.abs(groups).max(-1, keepdims=True).astype(np.float32)
    dx = (amax / np.float32(32767)).astype(np.float64)[..., 0]  # [rows, groups]
    inv = np.where(amax > 0, np.float32(32767) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    qx = np.rint(groups.astype(np.float32) * inv).astype(np.int64)  # [rows, groups, 32]
    per_sub = sub_block(weight.type_name)
    q = weight.q.numpy().astype(np.int64) - (32 if weight.type_name == "Q6_K" else 0)
    dots = np.einsum("rsk,nsk->rns", qx.reshape(rows, -1, per_sub), q.reshape(q.shape[0], -1, per_sub))
    scale = weight.d.double().numpy().repeat(256 // per_sub, 1) * weight.scales.numpy().astype(np.float64)
    y = (dots * scale[None] * dx.repeat(32 // per_sub, 1)[:, None, :]).sum(-1)
    if weight.mins is not None:
        offset = weight.dmin.double().numpy().repeat(8, 1) * weight.mins.numpy().astype(np.float64)
        y -= (offset[None] * (dx * qx.sum(-1))[:, None, :]).sum(-1)
    return torch.from_numpy(y).float().bfloat16().float()


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_decode_to_ggufs_dequantization_and_tiles_come_apart_again(type_name):
    for raw, rows in ((random_kquant_blocks(37, 512, type_name), 37),
                      (quantize_kquant(np.random.default_rng(1).standard_normal((24, 256)).astype(np.float32),
                                       type_name), 24)):
        weight = decode_kquant_blocks(raw, type_name, (rows, raw.shape[1] // KQUANT_TYPES[type_name] * 256))
        assert torch.equal(weight.dequantize(), _gguf_dequantized(raw, type_name))
        tiles = kquant_tiles.tile_kquant(weight)
        assert tuple(tiles.shape) == (-(-rows // 8), weight.shape[1] // 256, kquant_tiles.record_bytes(type_name))
        back = kquant_tiles.untile_kquant(tiles, rows, type_name)
        assert torch.equal(back.dequantize(), weight.dequantize())
        assert torch.equal(back.q, weight.q) and torch.equal(back.scales, weight.scales)


def test_records_read_as_few_bits_per_weight_as_llama_cpps_blocks_nearly():
    bits = {t: kquant_tiles.record_bytes(t) * 8 / (8 * 256) for t in TYPES}
    assert bits == {"Q4_K": 4.625, "Q5_K": 5.625, "Q6_K": 6.5625}


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 16, 256), (3, 37, 512), (6, 24, 1536), (33, 40, 768)])
def test_kernel_computes_the_k_quant_product(type_name, rows, out_features, in_features):
    raw, weight = _weight(type_name, out_features, in_features)
    x = torch.randn(rows, in_features) * 3
    x[0, :32] = 0  # an all-zero group
    y = cpu_packed.packed_gemm(x, kquant_tiles.tile_kquant(weight), out_features)
    ref = _reference(x, weight)
    step = ref.abs().clamp(min=1e-30) * 2.0 ** -7  # one bfloat16 step where float32 sums round otherwise
    assert bool(((y - ref).abs() <= step).all())
    exact = x.double() @ _gguf_dequantized(raw, type_name).double().t()
    assert float((y - exact).abs().max() / exact.abs().max()) < 1e-2


@pytest.mark.parametrize("type_name", TYPES)
def test_a_row_is_computed_the_same_at_any_position_in_any_batch(type_name):
    _, weight = _weight(type_name, 40, 512, seed=3)
    tiles = kquant_tiles.tile_kquant(weight)
    x = torch.randn(70, 512)
    alone = torch.cat([cpu_packed.packed_gemm(x[i:i + 1], tiles, 40) for i in range(70)])
    for rows in (2, 3, 4, 5, 9, 70):
        assert torch.equal(cpu_packed.packed_gemm(x[:rows], tiles, 40), alone[:rows]), rows


def _q5(type_name, rows, cols, seed=0):
    import gguf
    import gguf.quants

    dense = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(dense, getattr(gguf.GGMLQuantizationType, type_name))
    return raw, decode_gguf_blocks(raw, type_name, (rows, cols))


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 16, 32), (5, 37, 96), (33, 40, 576)])
def test_5_bit_codes_run_q4_records_with_their_fifth_bits(type_name, rows, out_features, in_features):
    raw, weight = _q5(type_name, out_features, in_features)
    tiles = cpu_packed.tile_q5(weight.q, weight.scales, weight.mins)
    assert tiles.shape[-1] == cpu_packed.Q5_RECORD  # 6 bits per weight
    codes, scales, mins = cpu_packed.untile(tiles, out_features)
    assert torch.equal(codes, weight.q) and torch.equal(scales, weight.scales) and torch.equal(mins, weight.mins)
    x = torch.randn(rows, in_features) * 3
    y = cpu_packed.packed_gemm(x, tiles, out_features)
    ref = _group_reference(x, weight)
    assert bool(((y - ref).abs() <= ref.abs().clamp(min=1e-30) * 2.0 ** -7).all())
    exact = x.double() @ _gguf_dequantized(raw, type_name).double().t()
    assert float((y - exact).abs().max() / exact.abs().max()) < 1e-2
    assert all(torch.equal(cpu_packed.packed_gemm(x[i:i + 1], tiles, out_features)[0], y[i]) for i in range(rows))


def test_a_non_finite_activation_makes_its_row_nan_and_no_other():
    _, weight = _weight("Q4_K", 16, 256)
    x = torch.randn(3, 256)
    x[1, 7] = float("inf")
    y = cpu_packed.packed_gemm(x, kquant_tiles.tile_kquant(weight), 16)
    assert bool(y[1].isnan().all()) and bool(y[[0, 2]].isfinite().all())


def test_vnni_and_avx2_multiply_to_the_same_bits(tmp_path):
    if cpu_packed.instruction_set() == "avx2":
        pytest.skip("needs a CPU with AVX-512 VNNI, where the kernels multiply with vpdpwssd")
    cases = []
    for type_name in TYPES:
        _, weight = _weight(type_name, 40, 512)
        for rows in (1, 2, 3, 4, 7):
            cases.append((torch.randn(rows, 512) * 3, kquant_tiles.tile_kquant(weight), 40))
    _, q5 = _q5("Q5_1", 40, 512)
    for rows in (1, 2, 3, 4, 7):
        cases.append((torch.randn(rows, 512) * 3, cpu_packed.tile_q5(q5.q, q5.scales, q5.mins), 40))
    for (x, tiles, n), theirs in zip(cases, products_capped_at("avx2", cases, tmp_path), strict=True):
        assert torch.equal(cpu_packed.packed_gemm(x, tiles, n), theirs)
