"""The packed GEMM's AMX-INT8 path (kernels/amx_gemm.cpp): whole blocks of 16 rows on the tile unit give
the bits of the vector tiles, checked against a process capped with STEPAHEAD_MAX_CPU_ISA=avx512_vnni
for every format, row counts around the 16-row blocks and panels, and a DecodeStack step."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from stepahead.kernels import cpu_build, cpu_packed
from stepahead.models.quant import kquant_tiles
from tests.kernels.test_cpu_decode_stack import _random_cache, _step
from tests.kernels.test_cpu_packed_gemm import _q8_0, _weight, capped_env, products_capped_at
from tests.kernels.test_kquant_gemm import _q5
from tests.kernels.test_kquant_gemm import _weight as _kquant_weight

pytestmark = pytest.mark.skipif(not cpu_build.machine_can_build(), reason="needs an AVX2 CPU and a C++ compiler")


@pytest.fixture(autouse=True)
def _amx():
    if cpu_packed.instruction_set() != "amx_int8":
        pytest.skip("needs a CPU with AMX-INT8 whose kernel grants the process the tile state")

ROW_COUNTS = (1, 15, 16, 17, 31, 32, 33, 48, 49, 64, 200)
EVERY_ROW_COUNT = (*range(1, 41), 64, 200)  # for the 4-bit and 8-bit records


def _formats() -> dict[str, tuple[torch.Tensor, int, int]]:
    """(tiles, N, K) per format. N = 40: five tiles, so the last column block is one tile; 70: padded."""
    q4, q8 = _weight(70, 576), _q8_0(40, 576)
    formats = {"int4 (Q4_1's values)": (cpu_packed.tile_q4(q4.q, q4.scales, q4.mins), 70, 576),
               "Q8_0": (cpu_packed.tile_q8(q8.q, q8.scales), 40, 576)}
    q4_0 = _weight(40, 576, seed=1)
    q4_0.mins = -8 * q4_0.scales  # Q4_0: w = (q - 8) d, kept as min -8 d
    formats["Q4_0"] = (cpu_packed.tile_q4(q4_0.q, q4_0.scales, q4_0.mins), 40, 576)
    for name in ("Q5_0", "Q5_1"):
        _, q5 = _q5(name, 40, 576)
        formats[name] = (cpu_packed.tile_q5(q5.q, q5.scales, q5.mins), 40, 576)
    for name in ("Q4_K", "Q5_K", "Q6_K"):  # Q6_K: sub-blocks of 16 inputs, half-size tiles
        _, weight = _kquant_weight(name, 40, 512)
        formats[name] = (kquant_tiles.tile_kquant(weight), 40, 512)
    return formats


def test_every_format_and_row_count_gives_the_vector_tiles_bits(tmp_path):
    cases, names = [], []
    torch.manual_seed(0)
    for name, (tiles, n, k) in _formats().items():
        for rows in EVERY_ROW_COUNT if name in ("int4 (Q4_1's values)", "Q8_0") else ROW_COUNTS:
            cases.append((torch.randn(rows, k) * 3, tiles, n))
            names.append((name, rows))
    for (x, tiles, n), theirs, name in zip(cases, products_capped_at("avx512_vnni", cases, tmp_path), names,
                                           strict=True):
        assert torch.equal(cpu_packed.packed_gemm(x, tiles, n), theirs), name


def test_a_long_prefill_in_panels_gives_the_vector_tiles_bits(tmp_path):
    """2,048 rows of 1,536 inputs: panels of 80 rows (five AMX blocks), the last one 48."""
    q4 = _weight(48, 1536)
    q8 = _q8_0(24, 1536)
    x = torch.randn(2048, 1536) * 3
    cases = [(x, cpu_packed.tile_q4(q4.q, q4.scales, q4.mins), 48), (x, cpu_packed.tile_q8(q8.q, q8.scales), 24)]
    for (x, tiles, n), theirs in zip(cases, products_capped_at("avx512_vnni", cases, tmp_path), strict=True):
        assert torch.equal(cpu_packed.packed_gemm(x, tiles, n), theirs)


def test_a_row_in_an_amx_block_is_the_row_alone_and_a_nan_stays_in_its_row():
    q4 = _weight(40, 576)
    tiles = cpu_packed.tile_q4(q4.q, q4.scales, q4.mins)
    x = torch.randn(33, 576)
    y = cpu_packed.packed_gemm(x, tiles, 40)
    for i in (0, 7, 15, 16, 31, 32):  # both AMX blocks and the vector tiles' last row
        assert torch.equal(cpu_packed.packed_gemm(x[i:i + 1], tiles, 40)[0], y[i])
    x[5, 100] = float("nan")
    y_nan = cpu_packed.packed_gemm(x, tiles, 40)
    assert bool(y_nan[5].isnan().all())
    others = [i for i in range(33) if i != 5]
    assert torch.equal(y_nan[others], y[others])


_STEP_RUN = """
import sys, torch
from stepahead.kernels import cpu_packed
from stepahead.models.loading.loader import load_model, load_model_config
from tests.kernels.test_amx_gemm import decode_step
model = load_model(load_model_config(sys.argv[1], "cpu", quantization=sys.argv[2]), "cpu")
torch.save((cpu_packed.instruction_set(), decode_step(model)), sys.argv[3])
"""


def decode_step(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A DecodeStack step of 37 decode rows (two AMX blocks and five rows) on a seeded random cache: the
    logits and the cache after it."""
    from stepahead.attention.rows import BatchRow

    assert model.decode_stack is not None
    rows = [BatchRow(i, 1, 3 + i % 7, [i + 1]) for i in range(37)]
    cache = _random_cache(model, 5, blocks=40)
    logits = _step(model, cache, rows, torch.arange(37) % 50 + 1)
    return logits, [t.clone() for t in cache.k + cache.v]


def test_a_decode_stack_step_gives_the_vector_tiles_bits(tiny_model_factory, tmp_path):
    """The built-in model's widths (576 hidden, 1,536 intermediate, 9 heads over 3 KV heads), int4, against
    a process without AMX but with the same 512-bit attention (the `avx512` cap: attention's AVX-512 and
    AVX2 loops agree only within float rounding)."""
    from stepahead.models.loading.loader import load_model, load_model_config

    folder = tiny_model_factory("llama", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                num_key_value_heads=3)
    model = load_model(load_model_config(str(folder), "cpu", quantization="int4"), "cpu")
    ours, our_cache = decode_step(model)
    subprocess.run([sys.executable, "-c", _STEP_RUN, str(folder), "int4", str(tmp_path / "step.pt")],
                   env=capped_env("avx512"), check=True, timeout=600)
    isa, (theirs, their_cache) = torch.load(tmp_path / "step.pt")
    assert isa == "avx512"
    assert torch.equal(ours, theirs)
    assert all(torch.equal(a, b) for a, b in zip(our_cache, their_cache, strict=True))
