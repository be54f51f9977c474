"""The fused Triton kernels of the CUDA path (q/k norm + rope; residual add + RMSNorm) against the torch
path they replace, through Triton's interpreter here, compiled on a GPU; and a runner using them
still gives transformers' greedy ids."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated
pytest.importorskip("triton")

from stepahead.attention import triton_fused
from stepahead.models.llama import apply_rope
from stepahead.worker.model_runner import ModelRunner
from tests.tiny_models import hf_greedy
from tests.worker.driver import MiniSched, make_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _torch_path(qk, cos_sin, num_q, q_weight, k_weight, eps):
    """Attention.forward's torch path: the norms (Qwen3), then rope, each in the model dtype."""
    cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]
    q, k = qk.split([num_q, qk.shape[1] - num_q], dim=1)
    if q_weight is not None:
        q = F.rms_norm(q, (q.shape[-1],), q_weight, eps)
        k = F.rms_norm(k, (k.shape[-1],), k_weight, eps)
    return torch.cat([apply_rope(q, cos, sin), apply_rope(k, cos, sin)], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_norm", [False, True], ids=["rope", "norm-rope"])
@pytest.mark.parametrize("num_q,num_kv,head_dim", [(4, 2, 16), (9, 3, 64), (2, 1, 12)])
def test_rope_qk_norm_matches_the_torch_path(dtype, with_norm, num_q, num_kv, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    tokens = 7
    # q and k as the model has them: a view of the fused q/k/v projection, v beside them untouched.
    fused = torch.randn(tokens, num_q + 2 * num_kv, head_dim, generator=g).to(DEVICE, dtype)
    qk, v = fused[:, :num_q + num_kv], fused[:, num_q + num_kv:].clone()
    angles = torch.rand(tokens, head_dim // 2, generator=g) * 6.0
    emb = torch.cat([angles, angles], dim=-1)
    cos_sin = torch.stack([emb.cos(), emb.sin()], dim=1).to(DEVICE, dtype)
    weights = (torch.rand(head_dim, generator=g).to(DEVICE, dtype) + 0.5,
               torch.rand(head_dim, generator=g).to(DEVICE, dtype) + 0.5) if with_norm else (None, None)
    expected = _torch_path(qk.clone(), cos_sin, num_q, *weights, 1e-6)
    out = triton_fused.rope_qk_norm_(qk, cos_sin, num_q, *weights, eps=1e-6)
    assert out is qk
    torch.testing.assert_close(qk.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(fused[:, num_q + num_kv:], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rms_norm_matches_the_torch_path(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g).to(DEVICE, dtype)
    y = torch.randn(5, hidden, generator=g).to(DEVICE, dtype)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(DEVICE, dtype)
    total, normed = triton_fused.add_rms_norm(x, y, weight, 1e-5)
    assert torch.equal(total, x + y)  # the stream's sum, rounded as the torch path rounds it
    torch.testing.assert_close(normed.float(), F.rms_norm(x + y, (hidden,), weight, 1e-5).float(),
                               rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_runner_with_fused_kernels_matches_transformers(tiny_model_factory, arch):
    """The Triton attention backend plus the fused kernels (the CUDA configuration, interpreted here).
    Phi-3's tiny model rotates 3/4 of each head, which the fused rope does not: it keeps torch's rope."""
    folder = tiny_model_factory(arch)
    prompts = [list(range(100, 121)), list(range(7, 12))]
    runner = ModelRunner(make_config(folder, attention_backend="triton", device=DEVICE, dtype="float32",
                                     max_num_seqs=len(prompts)))
    runner.model.use_triton_fused()
    layer = runner.model.layers[0]
    assert layer.fused_add_norm is not None and (layer.self_attn.fused_rope is None) == (arch == "phi3")
    sched = MiniSched(runner, 16, chunk=16)  # a chunked prefill beside a decode: a mixed step too
    for i, p in enumerate(prompts):
        sched.add(f"r{i}", p, 4)
    out = sched.run()
    assert [out["r0"], out["r1"]] == hf_greedy(folder, prompts, 4)
