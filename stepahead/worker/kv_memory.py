"""Sizing the KV pool on CUDA from --gpu-memory-utilization, the way vLLM users expect.

The pool gets what is left of `gpu_memory_utilization * total device memory` after everything else
the engine needs: what the device already holds once the weights are loaded (the weights, the CUDA
context, other processes), the activation peak of the largest step the scheduler may send (profiled:
a prefill of max_num_batched_tokens tokens, then logits and top-p sampling for max_num_seqs rows) and
the decode CUDA graphs' memory pool (profiled as the activation peak of a max_num_seqs decode step,
the largest graph, whose pool the smaller ones share).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

GiB = 2**30


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int  # the device's memory
    used_bytes: int  # held on the device before the KV pool: weights, CUDA context, other processes
    activation_peak_bytes: int  # the largest step's transient memory
    graph_pool_bytes: int  # the decode graphs' shared pool (0 without graphs)


def kv_pool_blocks(profile: MemoryProfile, gpu_memory_utilization: float, bytes_per_block: int,
                   max_useful_blocks: int) -> int:
    """Blocks (the null block included) that fit the budget, at most max_useful_blocks. May be < 2:
    the caller says the budget is too small."""
    budget = (int(gpu_memory_utilization * profile.total_bytes) - profile.used_bytes
              - profile.activation_peak_bytes - profile.graph_pool_bytes)
    return max(0, min(max_useful_blocks, budget // bytes_per_block))


def describe(profile: MemoryProfile, gpu_memory_utilization: float, num_blocks: int, block_size: int,
             bytes_per_block: int) -> str:
    return (f"KV cache: {num_blocks - 1} usable blocks of {block_size} tokens = {(num_blocks - 1) * block_size} "
            f"tokens, {num_blocks * bytes_per_block / GiB:.2f} GiB (gpu_memory_utilization "
            f"{gpu_memory_utilization:.2f} of {profile.total_bytes / GiB:.1f} GiB; before it "
            f"{profile.used_bytes / GiB:.2f} GiB held (weights, context, other processes), activation peak "
            f"{profile.activation_peak_bytes / GiB:.2f} GiB, decode graphs {profile.graph_pool_bytes / GiB:.2f} GiB)")


def peak_bytes(run) -> int:
    """The device memory `run()` allocates at its peak beyond what was allocated before it."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.empty_cache()
    return peak
