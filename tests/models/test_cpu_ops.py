"""stepahead's rope kernel (kernels/rope.cpp), built on this machine: bitwise torch's arithmetic, in place."""

from __future__ import annotations

import pytest
import torch

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
