"""stepahead's rope and RMSNorm kernels (kernels/rope.cpp, rms_norm.cpp), built on this machine: each
bitwise torch's arithmetic."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stepahead.kernels import cpu_build, cpu_ops
from stepahead.models.llama import apply_rope

# Where the machine can build the kernels they must build: a failed build fails these tests, not skips them.
pytestmark = pytest.mark.skipif(not cpu_build.machine_can_build(), reason="needs an AVX2 CPU and a C++ compiler")


# rotary_dim < head_dim: Phi-4-mini's partial rope (96 of 128), the rest of each head passes through
@pytest.mark.parametrize("tokens,heads,head_dim,rotary_dim", [(1, 12, 64, 64), (7, 5, 128, 128), (65, 3, 20, 20),
                                                              (9, 4, 128, 96), (3, 2, 20, 12)])
def test_rope_is_torchs_arithmetic_in_place(tokens, heads, head_dim, rotary_dim):
    torch.manual_seed(tokens)
    fused = torch.randn(tokens, heads + 2, head_dim)  # q and k heads, then a head that must stay as it is
    cos_sin = torch.randn(tokens, 2, rotary_dim)
    expected = apply_rope(fused[:, :heads], cos_sin[:, 0:1], cos_sin[:, 1:2])
    rotated = fused.clone()
    cpu_ops.rotary_embedding_(rotated[:, :heads], cos_sin)
    assert torch.equal(rotated[:, :heads], expected)
    assert torch.equal(rotated[:, heads:], fused[:, heads:])


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or not cpu_build.machine_can_build(),
                    reason="torch runs neither its AVX2 nor its AVX-512 kernels")
@pytest.mark.parametrize("dim", [8, 31, 64, 576, 960, 1000, 4096, 32767])  # 32767: the levels of torch's cascade
@pytest.mark.parametrize("rows", [1, 3, 65])
def test_rms_norm_is_torchs_arithmetic_bitwise(dim, rows):
    """Always on AVX2 torch; on AVX-512 torch wherever the check on the spot says so (on Zen 4 it does)."""
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        assert cpu_ops.rms_norm_is_torchs(dim)
    elif not cpu_ops.rms_norm_is_torchs(dim):
        pytest.skip("torch's AVX-512 kernels sum in another order on this CPU")
    assert not cpu_ops.rms_norm_is_torchs(cpu_ops.TORCH_SERIAL_SUM_LIMIT)
    torch.manual_seed(dim + rows)
    weight = torch.randn(dim)
    for scale in (1e-3, 1.0, 30.0):
        x = torch.randn(rows, dim) * scale
        assert torch.equal(cpu_ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (dim,), weight, 1e-5))
    heads = torch.randn(2, 3, 2 * dim)[:, :, :dim]  # a strided view, as Qwen3's per-head norms see
    assert torch.equal(cpu_ops.rms_norm(heads, weight, 1e-6), F.rms_norm(heads, (dim,), weight, 1e-6))


@pytest.mark.parametrize("rows,features", [(1, 8), (3, 1536), (5, 13)])  # 13: a tail past a multiple of 8
def test_silu_mul_agrees_with_torch_and_a_value_depends_on_its_inputs_alone(rows, features):
    gen = torch.Generator().manual_seed(features)
    gate_up = torch.randn(rows, 2 * features, generator=gen) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    out = cpu_ops.silu_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=3e-7, atol=1e-7)
    # the same gate and up values elsewhere in a row (the vector body or the tail) give the same bits
    shifted = cpu_ops.silu_mul(torch.cat((gate.roll(1, -1), up.roll(1, -1)), dim=-1))
    assert torch.equal(shifted.roll(-1, -1), out)


def test_silu_mul_at_the_ends_of_the_exponential():
    gate = torch.tensor([[-200.0, -90.0, -87.0, 0.0, 30.0, 88.0, 200.0, float("-inf"), float("inf"), float("nan"),
                          1e-30]])
    out = cpu_ops.silu_mul(torch.cat((gate, torch.full_like(gate, 2.0)), dim=-1))
    torch.testing.assert_close(out, F.silu(gate) * 2, rtol=3e-7, atol=1e-30, equal_nan=True)


def test_round_to_bf16_is_torchs_conversion_in_place():
    torch.manual_seed(0)
    x = torch.randn(37, 1000) * torch.logspace(-45, 38, 1000)  # subnormals to near float's limit
    x[0, :6] = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, 3.4e38, 1e-40])  # 3.4e38 rounds to inf
    rounded = x.clone()
    cpu_ops.round_to_bf16_(rounded)
    assert torch.equal(rounded, x.to(torch.bfloat16).float())
    assert torch.equal(rounded.view(torch.int32)[0, 3], torch.tensor(-0.0).view(torch.int32))
    nan = torch.tensor([float("nan"), 1.0])
    cpu_ops.round_to_bf16_(nan)
    assert bool(nan[0].isnan()) and nan[1].item() == 1.0
