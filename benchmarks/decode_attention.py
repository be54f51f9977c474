"""Decode attention per layer on CPU: stepahead's kernel alone at the built-in model's shapes (9 query
heads, 3 KV heads of 64, blocks of 16, float16 cache), every row one generated token over `context`
keys in scattered blocks. Each call reads the next of `--layers` caches, as a step's layers do, so the
figures include reading the cache from wherever the layers before left it. Medians of `--repeats`
calls, in microseconds per layer.

    python benchmarks/decode_attention.py [--threads 2] [--rows 1 32] [--contexts 128 512 2048]

STEPAHEAD_MAX_CPU_ISA=avx2 runs the kernel's AVX2 path on a CPU with AVX-512 (A/B runs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stepahead.kernels import cpu_ops

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def layer_caches(rows: int, context: int, layers: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`layers` (k_cache, v_cache, block_table) triples, each row's blocks scattered over its layer's cache."""
    blocks = -(-context // BLOCK)
    num_blocks = rows * blocks + 1
    caches = []
    for _ in range(layers):
        k_cache, v_cache = (torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM).half() for _ in range(2))
        table = (torch.randperm(num_blocks - 1) + 1).view(rows, blocks)
        caches.append((k_cache, v_cache, table))
    return caches


def median_us(rows: int, context: int, layers: int, repeats: int) -> float:
    caches = layer_caches(rows, context, layers)
    q = torch.randn(rows, HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    lens = torch.full((rows,), context, dtype=torch.long)
    scale = HEAD_DIM ** -0.5
    times = []
    for call in range(repeats + layers):
        k_cache, v_cache, table = caches[call % layers]
        start = time.perf_counter()
        cpu_ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, out)
        if call >= layers:  # the first pass over the layers only warms up
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=90)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for rows in args.rows:
        for context in args.contexts:
            us = median_us(rows, context, args.layers, args.repeats)
            print(f"{rows} rows x {context} keys: {us:.1f} us per layer", flush=True)


if __name__ == "__main__":
    main()
