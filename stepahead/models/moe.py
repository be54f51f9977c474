"""Mixture-of-experts feed-forward blocks (Qwen3-MoE, Mixtral): a router picks top_k experts per token
and the block returns the routing-weighted sum of those experts' SwiGLU MLPs.

Experts run grouped: the step's (token, expert) pairs are sorted by expert, so each expert multiplies
one contiguous run of rows and its weights are read once per step however many tokens chose it.
On CPU (dense or packed experts, models/quant) that is one matrix product per expert that has rows,
never one per token. On CUDA, bfloat16 experts run as two `torch._grouped_mm` calls over every expert
at once (no host synchronisation, so a CUDA graph can hold the step); not run on a GPU here. On CPU
torch's grouped call multiplies every expert, rows or not, so the per-expert loop is the faster.

With tensor parallelism each rank holds every expert's slice of the intermediate features (gate/up
rows split, down columns split, as vLLM splits them) and the block ends in one all-reduce; the router
is replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stepahead.distributed.comm import tp_all_reduce
from stepahead.distributed.state import SINGLE, ParallelState
from stepahead.models.quant.prompt_rows import PromptRows

# torch._grouped_mm needs row strides that are multiples of 16 bytes.
_GROUPED_ALIGNMENT_BYTES = 16


@dataclass(frozen=True)
class MoeArgs:
    """What a checkpoint's config says about its experts."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    # Whether the top_k routing weights are rescaled to sum to one (Mixtral always; Qwen3-MoE when
    # norm_topk_prob). Renormalising the softmax's top_k probabilities is the softmax over the top_k
    # logits, which is how Mixtral defines its weights.
    renormalize: bool
    sparse_layers: tuple[int, ...]  # global indices of the layers whose MLP is a MoE block

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.intermediate_size < 1:
            raise ValueError(f"the experts' intermediate size must be positive, got {self.intermediate_size}")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> (weights [T, top_k] float32, expert ids [T, top_k] long), best first.

    Softmax over all experts in float32, then the top_k; among equal probabilities the lower expert id
    wins (a stable sort), so ties route the same way on every device and in every batch."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(frozen=True)
class ExpertGroups:
    """A step's (token, expert) pairs sorted by expert: pair p is token p // top_k's (p % top_k)-th choice."""

    order: torch.Tensor  # [T * top_k] long: the pairs, by expert (stable: by token within an expert)
    rows: torch.Tensor  # [T * top_k] long: the token of each sorted pair
    counts: torch.Tensor  # [E] long: how many pairs each expert has

    @staticmethod
    def of(expert_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # index_add_, not bincount: bincount waits for the device to learn the largest id.
        counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        return ExpertGroups(order, torch.div(order, expert_ids.shape[1], rounding_mode="floor"), counts)


def run_each_expert(x: torch.Tensor, counts: torch.Tensor, out_features: int,
                    expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [N, in] sorted by expert -> [N, out_features]: expert(e, rows of e) for every expert with rows."""
    out = x.new_empty(x.shape[0], out_features)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[start:start + n] = expert(e, x[start:start + n])
            start += n
    return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Every expert's SwiGLU MLP over its run of x's rows (sorted by expert) in two grouped GEMMs:
    gate_up [E, 2 * I, H], down [E, H, I] -> [N, H]."""
    offsets = counts.cumsum(0).to(torch.int32)
    h = swiglu(torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offsets))
    return torch._grouped_mm(h, down.transpose(1, 2), offs=offsets)


class DenseExperts(nn.Module):
    """Every expert's weights in the model's dtype: gate_up_proj [E, 2 * I, H] (gate rows, then up rows,
    this rank's slice of each) and down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def runs_grouped(self) -> bool:
        """Whether forward is two grouped GEMMs (else one product per expert that has rows, reading the
        row counts on the host): off the CPU, in bfloat16 (torch's grouped CUDA kernel), with row
        strides 16-byte aligned."""
        w = self.down_proj
        aligned = all(n * w.element_size() % _GROUPED_ALIGNMENT_BYTES == 0 for n in w.shape[1:])
        return aligned and w.device.type != "cpu" and w.dtype == torch.bfloat16

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, H]: rows sorted by expert, counts[e] of them for expert e -> [N, H]."""
        if self.runs_grouped():
            return grouped_swiglu(x, counts, self.gate_up_proj, self.down_proj)
        return run_each_expert(x, counts, x.shape[1], lambda e, rows: F.linear(
            swiglu(F.linear(rows, self.gate_up_proj[e])), self.down_proj[e]))


class PackedExperts(nn.Module):
    """Every expert as two packed linears (models/quant/quantized_linear.py), run one expert at a time:
    each expert with rows reads its packed weights once. Every row runs the packed kernels, which
    compute a row on its own, so a token's result does not depend on its batch."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module]) -> None:
        super().__init__()
        if len(gate_up) != len(down):
            raise ValueError(f"{len(gate_up)} packed gate/up projections for {len(down)} down projections")
        self.num_experts = len(down)
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return run_each_expert(x, counts, x.shape[1], lambda e, rows: self.down[e](swiglu(self.gate_up[e](rows))))


class MoeBlock(nn.Module):
    """The MLP of a sparse layer: the router (`gate`, replicated) and this rank's slice of the experts."""

    def __init__(self, hidden_size: int, moe: MoeArgs, ps: ParallelState = SINGLE) -> None:
        super().__init__()
        self.ps = ps
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts: DenseExperts | PackedExperts = DenseExperts(moe.num_experts, hidden_size,
                                                                  moe.intermediate_size // ps.tp_size)

    def forward(self, x: torch.Tensor, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. prompt_rows is unused: packed experts run every row packed."""
        t = x.shape[0]
        weights, ids = route(F.linear(x, self.gate.weight), self.top_k, self.renormalize)
        groups = ExpertGroups.of(ids, self.gate.out_features)
        y = self.experts(x.index_select(0, groups.rows), groups.counts)
        y = y * weights.reshape(-1).index_select(0, groups.order).unsqueeze(1).to(y.dtype)
        # Back to (token, choice) order and summed per token: no atomics, the same sum in any batch.
        per_choice = torch.empty_like(y).index_copy_(0, groups.order, y)
        out = per_choice.view(t, self.top_k, y.shape[1]).sum(dim=1)
        return out if self.ps.tp_size == 1 else tp_all_reduce(out, self.ps)
