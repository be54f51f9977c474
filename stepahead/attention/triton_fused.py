"""Two fused Triton kernels for the Llama family's layers on CUDA (LlamaForCausalLM.use_triton_fused).

A decode step of a small model is hundreds of small kernels; rope alone is a dozen torch ops a layer
(slices, a concatenation, products, sums) and Qwen3's per-head q/k norms add two RMSNorms. These do
in one launch each what the torch path does in many, computing in fp32 and rounding once:

- rope_qk_norm_: optional per-head RMSNorm of q and k (Qwen3), then rotary embedding (rotate-half,
  as HF checkpoints), in place over the fused projection's q and k heads; one program per token.
- add_rms_norm: the residual add and the next RMSNorm; returns the sum (rounded to the stream's dtype,
  which the norm then reads, as the torch path does) and its norm; one program per token.

Tested against the torch path through Triton's interpreter (tests/attention/test_triton_fused.py); the CPU
path never calls them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stepahead.attention.triton_paged import KernelLaunch


@triton.jit
def _rope_qk_norm_kernel(
    x_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, eps,
    stride_xt, stride_xh, stride_xd, stride_ct, stride_cs, stride_cd,
    NUM_HEADS: tl.constexpr, NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_HEADS) & (d < HALF)
    lo = x_ptr + tok * stride_xt + h * stride_xh + d * stride_xd  # the first half of each head
    hi = lo + HALF * stride_xd
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(hi, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        # Each head normed over its head_dim with q's weights (heads < NUM_Q_HEADS) or k's; the torch
        # path rounds the norm's output to the model dtype before rope: so does this.
        inv = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        is_q = h < NUM_Q_HEADS
        dd = tl.arange(0, BLOCK_HALF)[None, :]
        w1 = tl.where(is_q, tl.load(q_weight_ptr + dd, mask=dd < HALF, other=0.0),
                      tl.load(k_weight_ptr + dd, mask=dd < HALF, other=0.0)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(q_weight_ptr + HALF + dd, mask=dd < HALF, other=0.0),
                      tl.load(k_weight_ptr + HALF + dd, mask=dd < HALF, other=0.0)).to(tl.float32)
        x1 = (x1 * inv * w1).to(x_ptr.dtype.element_ty).to(tl.float32)
        x2 = (x2 * inv * w2).to(x_ptr.dtype.element_ty).to(tl.float32)
    c = cos_sin_ptr + tok * stride_ct + d * stride_cd
    d_ok = d < HALF
    cos1 = tl.load(c, mask=d_ok, other=0.0).to(tl.float32)
    cos2 = tl.load(c + HALF * stride_cd, mask=d_ok, other=0.0).to(tl.float32)
    sin1 = tl.load(c + stride_cs, mask=d_ok, other=0.0).to(tl.float32)
    sin2 = tl.load(c + stride_cs + HALF * stride_cd, mask=d_ok, other=0.0).to(tl.float32)
    # rotate-half: [x1, x2] * cos + [-x2, x1] * sin
    tl.store(lo, (x1 * cos1 - x2 * sin1).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(hi, (x2 * cos2 + x1 * sin2).to(x_ptr.dtype.element_ty), mask=mask)


def rope_qk_norm_(qk: torch.Tensor, cos_sin: torch.Tensor, num_q_heads: int,
                  q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                  eps: float = 1e-6) -> torch.Tensor:
    """In place: qk [T, q heads + k heads, hd] (strided views allowed), cos_sin [T, 2, hd]; with weights,
    each q head RMSNormed with q_weight and each k head with k_weight first. Returns qk."""
    if qk.shape[0]:
        rope_qk_norm_launch(qk, cos_sin, num_q_heads, q_weight, k_weight, eps).run()
    return qk


def rope_qk_norm_launch(qk: torch.Tensor, cos_sin: torch.Tensor, num_q_heads: int,
                        q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                        eps: float = 1e-6) -> KernelLaunch:
    """The launch rope_qk_norm_ runs (same arguments; also what attention/triton_aot.py compiles)."""
    num_tokens, num_heads, head_dim = qk.shape
    has_norm = q_weight is not None
    half = head_dim // 2
    block = triton.next_power_of_2(num_heads) * triton.next_power_of_2(half)
    return KernelLaunch(_rope_qk_norm_kernel, (num_tokens,), (
        qk, cos_sin, q_weight if has_norm else qk, k_weight if has_norm else qk, eps,
        *qk.stride(), *cos_sin.stride(),
    ), dict(
        NUM_HEADS=num_heads, NUM_Q_HEADS=num_q_heads, HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HALF=triton.next_power_of_2(half), HAS_NORM=has_norm,
        num_warps=4 if block >= 2048 else 1,
    ))


@triton.jit
def _add_rms_norm_kernel(x_ptr, y_ptr, sum_ptr, out_ptr, weight_ptr, eps, n, stride_x, stride_y, stride_s,
                         stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
    # The sum rounded to the stream's dtype, as `h + y` is in the torch path, and normed from there.
    s = (x + y).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * stride_s + cols, s, mask=ok)
    s = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(s * s, 0) / n + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, rms_norm(x + y) * weight) of [T, hidden] rows (last dimension contiguous), in x's dtype."""
    if x.stride(-1) != 1 or y.stride(-1) != 1:
        raise ValueError("add_rms_norm reads rows with contiguous columns")
    total, normed = torch.empty_like(x), torch.empty_like(x)
    if x.shape[0]:
        add_rms_norm_launch(x, y, weight, eps, total, normed).run()
    return total, normed


def add_rms_norm_launch(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, total: torch.Tensor,
                        normed: torch.Tensor) -> KernelLaunch:
    """The launch add_rms_norm runs, into total and normed (also what attention/triton_aot.py compiles)."""
    num_tokens, hidden = x.shape
    block = triton.next_power_of_2(hidden)
    return KernelLaunch(_add_rms_norm_kernel, (num_tokens,), (
        x, y, total, normed, weight, eps, hidden, x.stride(0), y.stride(0), total.stride(0), normed.stride(0),
    ), dict(BLOCK=block, num_warps=min(16, max(1, block // 256))))
