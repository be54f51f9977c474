"""Decode attention per layer on CPU with stepahead's kernel: a full layer against windowed ones (a
windowed row reads only its window's blocks) and the cost of a logit cap, at Gemma 2 2B's shapes
(8 query heads, 4 KV heads of 256, blocks of 16, bfloat16 cache), medians of 15 calls.

    python benchmarks/window_attention.py [--rows 16] [--context 4096] [--threads 2]
"""

from __future__ import annotations

import argparse

import torch
from prompt_attention import median_ms  # beside this script (its folder is on the path when run)

from stepahead.kernels import cpu_ops

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 256, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    blocks = -(-args.context // BLOCK)
    k_cache, v_cache = (torch.randn(KV_HEADS, args.rows * blocks + 1, BLOCK, HEAD_DIM).bfloat16() for _ in range(2))
    table = (torch.arange(args.rows * blocks) + 1).view(args.rows, blocks)
    lens = torch.full((args.rows,), args.context, dtype=torch.long)
    q = torch.randn(args.rows, HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    print(f"{args.rows} rows of {args.context} keys, {args.threads} threads")
    print("window   softcap   ms per layer")
    for window, softcap in ((None, None), (None, 50.0), (args.context // 4, None), (args.context // 16, 50.0)):
        ms = median_ms(lambda w=window, c=softcap: cpu_ops.paged_decode_attention(
            q, k_cache, v_cache, table, lens, HEAD_DIM ** -0.5, out, w, c))
        print(f"{window or 'none':>6}   {softcap or 'none':>7}   {ms:8.3f}")


if __name__ == "__main__":
    main()
