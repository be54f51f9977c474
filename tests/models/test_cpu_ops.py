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


@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 12, 64), (7, 5, 128), (65, 3, 20)])
def test_rope_is_torchs_arithmetic_in_place(tokens, heads, head_dim):
    torch.manual_seed(tokens)
    fused = torch.randn(tokens, heads + 2, head_dim)  # q and k heads, then a head that must stay as it is
    cos_sin = torch.randn(tokens, 2, head_dim)
    expected = apply_rope(fused[:, :heads], cos_sin[:, 0:1], cos_sin[:, 1:2])
    rotated = fused.clone()
    cpu_ops.rotary_embedding_(rotated[:, :heads], cos_sin)
    assert torch.equal(rotated[:, :heads], expected)
    assert torch.equal(rotated[:, heads:], fused[:, heads:])


@pytest.mark.skipif(not cpu_ops.rms_norm_is_torchs(64), reason="torch sums in 16 lanes on AVX-512: kernel not used")
@pytest.mark.parametrize("dim", [8, 31, 64, 576, 960, 1000, 4096, 32767])  # 32767: the levels of torch's cascade
@pytest.mark.parametrize("rows", [1, 3, 65])
def test_rms_norm_is_torchs_arithmetic_bitwise(dim, rows):
    assert cpu_ops.rms_norm_is_torchs(dim) and not cpu_ops.rms_norm_is_torchs(cpu_ops.TORCH_SERIAL_SUM_LIMIT)
    torch.manual_seed(dim + rows)
    weight = torch.randn(dim)
    for scale in (1e-3, 1.0, 30.0):
        x = torch.randn(rows, dim) * scale
        assert torch.equal(cpu_ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (dim,), weight, 1e-5))
    heads = torch.randn(2, 3, 2 * dim)[:, :, :dim]  # a strided view, as Qwen3's per-head norms see
    assert torch.equal(cpu_ops.rms_norm(heads, weight, 1e-6), F.rms_norm(heads, (dim,), weight, 1e-6))
