"""Decode-step CUDA graphs: the whole forward pass of a decode-only step replayed as one launch.

A decode step of a small model is hundreds of tiny kernels; launched one by one from Python they, not
the GPU, set the pace. So at start-up the runner captures the forward pass once per padded batch size
(1, 2, 4, 8, then every 8 up to 256 and every 16 beyond, up to max_num_seqs) over fixed device buffers
(token ids, positions, KV slots, block table, context lengths), and a decode-only step copies its inputs
into those buffers and replays the graph of the smallest size that holds it. Padding rows have context
length 0 and KV slot -1, so the kernels skip them. Steps with a multi-token row run eagerly.

All graphs share one memory pool and are captured largest first, so the pool is sized by the largest.
Before `capture` (or off CUDA) `run` executes the same padded forward pass eagerly over the same
buffers, which is how the padding is tested without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import cast

import torch

from stepahead.attention.paged_cache import PagedKVCache
from stepahead.attention.triton_backend import TritonMetadata
from stepahead.config import EngineConfig
from stepahead.distributed.state import ParallelState
from stepahead.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then steps of 8 to 256 and of 16 beyond, and max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    size = 8
    while size < max_num_seqs:
        sizes.append(size)
        size += 8 if size < 256 else 16
    sizes.append(max_num_seqs)
    return sizes


@dataclass
class DecodeBatch:
    """A decode-only step's inputs, as device tensors of num_rows entries (one token per row)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: TritonMetadata  # its block table may be narrower than the graphs' buffer


class DecodeGraphs:
    """Captured decode forward passes and the fixed buffers they read."""

    def __init__(self, model, kv_cache: PagedKVCache, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = capture_sizes(max_num_seqs)
        rows = self.sizes[-1]

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.input_ids = buffer(rows)
        self.positions = buffer(rows)
        self.slot_mapping = buffer(rows).fill_(-1)
        self.block_table = buffer(rows, max_blocks_per_seq)
        self.seq_lens = buffer(rows)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int64, device=device)  # one token per row
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, size: int) -> TritonMetadata:
        return TritonMetadata(self.slot_mapping[:size], self.block_table[:size], self.seq_lens[:size],
                              self.query_start_loc[:size + 1], max_query_len=1)

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, self._metadata(size))

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.monotonic()
        free_before, _ = torch.cuda.mem_get_info()
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: compiles kernels and settles the allocator outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s, using %.2f GiB",
                    len(self.graphs), self.sizes[0], self.sizes[-1], time.monotonic() - started,
                    (free_before - free_after) / 2**30)

    def padded_size(self, num_rows: int) -> int | None:
        """The smallest captured size that holds num_rows rows, or None when none does."""
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, inputs: StepInputs) -> torch.Tensor | None:
        """The hidden states of a decode-only step, from the smallest graph that holds it; None for a step
        with a multi-token row or more rows than any graph (it runs eagerly)."""
        if inputs.max_query_len != 1:
            return None
        size = self.padded_size(inputs.input_ids.shape[0])
        if size is None:
            return None
        metadata = cast(TritonMetadata, inputs.attn_metadata)  # graphs run with the Triton backend only
        return self.run(DecodeBatch(inputs.input_ids, inputs.positions, metadata), size)

    def run(self, batch: DecodeBatch, size: int) -> torch.Tensor:
        """Copy the step into the fixed buffers, replay the graph of `size` rows; hidden states [num_rows, hidden]."""
        rows = batch.input_ids.shape[0]
        meta = batch.metadata
        width = meta.block_table.shape[1]
        self.input_ids[:rows].copy_(batch.input_ids)
        self.positions[:rows].copy_(batch.positions)
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.seq_lens[:rows].copy_(meta.seq_lens)
        self.block_table[:rows, :width].copy_(meta.block_table)
        if size > rows:  # padding rows: no KV write, no keys
            self.slot_mapping[rows:size].fill_(-1)
            self.seq_lens[rows:size].zero_()
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:rows]
        graph.replay()
        return self.outputs[size][:rows]


def capture_decode_graphs(config: EngineConfig, ps: ParallelState, model, kv_cache: PagedKVCache,
                          max_blocks_per_seq: int, device: torch.device) -> DecodeGraphs | None:
    """The decode graphs, captured: on CUDA with the Triton backend at one rank, unless eager or the model
    waits on the device within a step (experts run one at a time, models/moe.py); else None."""
    if (device.type != "cuda" or config.attention_backend != "triton" or config.enforce_eager
            or ps.world_size != 1 or not model.can_capture_graphs()):
        return None
    graphs = DecodeGraphs(model, kv_cache, config.scheduler_config.max_num_seqs, max_blocks_per_seq, device)
    graphs.capture()
    return graphs
