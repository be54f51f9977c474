"""Prompt attention per layer on CPU: stepahead's kernel (each prompt token a row at its own position)
against one causal SDPA call over same-length prompts (the SDPA path's best case), the built-in
model's shapes (9 query heads, 3 KV heads of 64, blocks of 16, float16 cache), medians of 15 calls.

    python benchmarks/prompt_attention.py [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from stepahead.kernels import cpu_ops

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = [(32, 64), (8, 256), (1, 512), (4, 512), (1, 2048)]  # (prompts, tokens each)


def median_ms(fn, repeats: int = 15) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(prompts: int, tokens: int) -> tuple[float, float]:
    blocks = -(-tokens // BLOCK)
    num_blocks = prompts * blocks + 1
    k_cache, v_cache = (torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM).half() for _ in range(2))
    rows = prompts * tokens
    q = torch.randn(rows, HEADS, HEAD_DIM)
    k, v = torch.randn(rows, KV_HEADS, HEAD_DIM), torch.randn(rows, KV_HEADS, HEAD_DIM)
    table = torch.arange(1, num_blocks).view(prompts, blocks).repeat_interleave(tokens, 0).contiguous()
    lens = torch.arange(1, tokens + 1).repeat(prompts)
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5

    def kernel():
        cpu_ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, out)

    def sdpa():
        qp, kp, vp = (x.view(prompts, tokens, -1, HEAD_DIM).transpose(1, 2) for x in (q, k, v))
        F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)

    return median_ms(kernel), median_ms(sdpa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for prompts, tokens in SHAPES:
        by_kernel, by_sdpa = measure(prompts, tokens)
        print(f"{prompts} x {tokens} tokens: kernel {by_kernel:.2f} ms, SDPA {by_sdpa:.2f} ms per layer "
              f"({by_sdpa / by_kernel:.2f}x)")


if __name__ == "__main__":
    main()
