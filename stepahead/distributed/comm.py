"""The communication the model and runner do: all-reduce and all-gather in the tensor-parallel group,
hidden states stage to stage, and the sampled tokens from the sampler rank to every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from stepahead.distributed.state import ParallelState


def tp_all_reduce(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Sum over the stage's tensor-parallel ranks, in place (x at tp_size 1)."""
    if ps.tp_size > 1:
        dist.all_reduce(x, group=ps.tp_group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Concatenate every tensor-parallel rank's x along the last dimension, in rank order."""
    if ps.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ps.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=ps.tp_group)
    return torch.cat(parts, dim=-1)


def send_hidden(hidden: torch.Tensor, ps: ParallelState) -> None:
    """To the same tensor rank of the next stage."""
    dist.send(hidden.contiguous(), dst=ps.next_stage_rank(), group=ps.world_group)


def recv_hidden(out: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """From the same tensor rank of the previous stage, into out ([num_tokens, hidden_size])."""
    dist.recv(out, src=ps.prev_stage_rank(), group=ps.world_group)
    return out


def broadcast_sampled(ids: torch.Tensor, ps: ParallelState):
    """Start broadcasting a step's sampled ids from the sampler rank to every rank; returns the work handle."""
    return dist.broadcast(ids, src=ps.sampler_rank, group=ps.world_group, async_op=True)
