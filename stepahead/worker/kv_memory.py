"""Sizing the KV pool on CUDA from --gpu-memory-utilization, the way vLLM users expect.

The pool gets what is left of `gpu_memory_utilization * total device memory` after everything else
the engine needs: what the device holds after the profiling steps (the weights, the CUDA context, cuBLAS
workspaces and kernels, other processes), the activation peak of the largest step the scheduler may send (profiled:
a prefill of max_num_batched_tokens tokens, then logits and top-p sampling for max_num_seqs rows) and
the decode CUDA graphs' memory pool (profiled as the activation peak of a max_num_seqs decode step,
the largest graph, whose pool the smaller ones share).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from stepahead.attention.paged_cache import PagedKVCache
from stepahead.attention.rows import BatchRow
from stepahead.config import EngineConfig
from stepahead.distributed.state import ParallelState
from stepahead.sampling_params import SamplingParams
from stepahead.utils import cdiv
from stepahead.worker.sampler import sample
from stepahead.worker.sampling_metadata import RowSampling, SamplingMetadata
from stepahead.worker.staging import StagingBuffer

logger = logging.getLogger(__name__)

GiB = 2**30


class ProfiledRunner(Protocol):
    """What profiling needs of the ModelRunner (which imports this module)."""

    config: EngineConfig
    ps: ParallelState
    device: torch.device
    block_size: int
    staging: StagingBuffer
    attention_backend: Any
    model: Any
    spec: Any  # SpecDecoder | None (its draft model's KV shares the pool's blocks)

    def new_kv_cache(self, num_blocks: int) -> PagedKVCache: ...


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
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.empty_cache()
    return peak


def pool_blocks(runner: ProfiledRunner, max_blocks_per_seq: int) -> int:
    """The KV pool's size in blocks: cache_config.num_blocks, or what gpu_memory_utilization leaves of the
    device (every rank holds the same block ids: the smallest pool fits all). On CUDA without it, a
    dummy step compiles the kernels a prefill uses before the first request."""
    cache_config, sched = runner.config.cache_config, runner.config.scheduler_config
    if cache_config.gpu_memory_utilization is None:
        if runner.device.type == "cuda":
            dummy_step(runner, min(64, sched.max_num_batched_tokens, 2 * sched.max_model_len), 2)
        return cache_config.num_blocks
    num_blocks = blocks_from_memory(runner, cache_config.gpu_memory_utilization, max_blocks_per_seq)
    if runner.ps.world_size > 1:
        blocks = torch.tensor([num_blocks], device=runner.device)
        torch.distributed.all_reduce(blocks, op=torch.distributed.ReduceOp.MIN, group=runner.ps.world_group)
        num_blocks = int(blocks.item())
    return num_blocks


def blocks_from_memory(runner: ProfiledRunner, gpu_memory_utilization: float, max_blocks_per_seq: int) -> int:
    """The KV pool size (blocks) that fits gpu_memory_utilization of the device, after profiling."""
    sched = runner.config.scheduler_config
    # The largest step: max_num_batched_tokens of prefill, in rows no longer than max_model_len.
    largest_step = peak_bytes(
        lambda: dummy_step(runner, sched.max_num_batched_tokens, cdiv(sched.max_num_batched_tokens, sched.max_model_len)))
    graphs = 0
    if runner.config.attention_backend == "triton" and not runner.config.enforce_eager:
        graphs = peak_bytes(lambda: dummy_step(runner, sched.max_num_seqs, sched.max_num_seqs))
    # Measured after the profiling steps, so what they loaded outside torch's allocator (cuBLAS
    # workspaces, kernel images, Triton modules) counts as held.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    profile = MemoryProfile(total, total - free, largest_step, graphs)
    # A draft model keeps its own KV for the same block ids: a block costs both models' bytes.
    bytes_per_block = runner.block_size * (runner.config.model_config.kv_bytes_per_token(
        runner.config.cache_config.cache_dtype) + (runner.spec.kv_bytes_per_token() if runner.spec else 0))
    num_blocks = kv_pool_blocks(profile, gpu_memory_utilization, bytes_per_block,
                                runner.config.cache_config.num_blocks)
    if num_blocks - 1 < max_blocks_per_seq:
        raise ValueError(
            f"gpu_memory_utilization {gpu_memory_utilization} leaves room for {max(0, num_blocks - 1)} KV blocks, "
            f"but one max_model_len ({sched.max_model_len}) sequence needs {max_blocks_per_seq}: raise "
            f"--gpu-memory-utilization, or lower --max-model-len or --max-num-batched-tokens")
    logger.info(describe(profile, gpu_memory_utilization, num_blocks, runner.block_size, bytes_per_block))
    return num_blocks


@torch.inference_mode()
def dummy_step(runner: ProfiledRunner, num_tokens: int, num_rows: int) -> None:
    """A forward pass of num_tokens new tokens in num_rows rows over a one-block scratch cache, then the
    logits and top-p sampling of up to max_num_seqs rows: the memory a real step of that shape needs."""
    scratch = runner.new_kv_cache(1)
    per_row = cdiv(num_tokens, num_rows)
    rows, start = [], 0
    while start < num_tokens:
        n = min(per_row, num_tokens - start)
        rows.append(BatchRow(start, n, 0, [0] * cdiv(n, runner.block_size)))
        start += n
    positions = torch.cat([torch.arange(row.num_new_tokens, device=runner.device) for row in rows])
    runner.staging.reset()
    # The backends take the number of *leading* one-token rows (a runner's step sorts them first).
    num_decode_rows = next((i for i, row in enumerate(rows) if row.num_new_tokens != 1), len(rows))
    staged = runner.attention_backend.stage(rows, num_decode_rows, runner.staging)
    runner.staging.upload()
    metadata = runner.attention_backend.finish(staged, positions % runner.block_size, runner.staging)  # block 0
    hidden = runner.model(torch.zeros_like(positions), positions, scratch, metadata)
    num_sample = min(num_tokens, runner.config.scheduler_config.max_num_seqs)
    logits = runner.model.compute_logits(hidden[:num_sample]).float()
    # Top-p sorts the vocabulary; penalties build [rows, vocab] tables: the sampler's worst case.
    worst = SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.1, repetition_penalty=1.1)
    rows_sampling = [RowSampling(worst, [1], [1], [])] * num_sample
    sample(logits, SamplingMetadata.from_rows(rows_sampling, logits.shape[1], runner.device))
