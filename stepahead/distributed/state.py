"""Process groups of the worker ranks: world, tensor-parallel and pipeline-parallel.

Rank layout: rank = pp_rank * tp_size + tp_rank, so a pipeline stage's tensor-parallel ranks are
consecutive. Every rank builds every group (torch.distributed requires all ranks to call new_group
for every group, in the same order) and keeps only its own. The state is passed explicitly to the
model and the runner; nothing here is module-global.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch


def rank_of(pp_rank: int, tp_rank: int, tp_size: int) -> int:
    return pp_rank * tp_size + tp_rank


@dataclass
class ParallelState:
    """One rank's place in the world and its groups (None at world size 1: no torch.distributed at all)."""

    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    tp_group: Any = None  # torch.distributed ProcessGroup of this rank's stage
    world_group: Any = None  # every rank: p2p between stages and the sampled-token broadcast
    # Each stage's layer count, as ParallelConfig.pp_layer_partition; None: the default split.
    layer_partition: tuple[int, ...] | None = None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        return rank_of(self.pp_rank, self.tp_rank, self.tp_size)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def sampler_rank(self) -> int:
        """The rank that samples and reports outputs: tensor rank 0 of the last stage."""
        return rank_of(self.pp_size - 1, 0, self.tp_size)

    @property
    def is_sampler(self) -> bool:
        return self.rank == self.sampler_rank

    def prev_stage_rank(self) -> int:
        return rank_of(self.pp_rank - 1, self.tp_rank, self.tp_size)

    def next_stage_rank(self) -> int:
        return rank_of(self.pp_rank + 1, self.tp_rank, self.tp_size)


SINGLE = ParallelState()

# How long a collective waits for a peer before raising: a dead peer usually closes the connection
# first (gloo raises at once); this bounds the rest.
_TIMEOUT = datetime.timedelta(seconds=60)


def init_parallel_state(rank: int, tp_size: int, pp_size: int, master_addr: str, master_port: int,
                        device: str, layer_partition: tuple[int, ...] | None = None) -> ParallelState:
    """Join the world over a TCP store (gloo on CPU, NCCL on CUDA) and build the TP groups."""
    import torch.distributed as dist

    world = tp_size * pp_size
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world, timeout=_TIMEOUT)
    tp_group = None
    for pp in range(pp_size):
        ranks = [rank_of(pp, t, tp_size) for t in range(tp_size)]
        group = dist.new_group(ranks, timeout=_TIMEOUT)
        if rank in ranks:
            tp_group = group
    return ParallelState(tp_size=tp_size, pp_size=pp_size, tp_rank=rank % tp_size, pp_rank=rank // tp_size,
                         tp_group=tp_group, world_group=dist.group.WORLD, layer_partition=layer_partition)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port free on host now, for rank 0's TCP store."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
