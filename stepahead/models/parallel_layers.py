"""Tensor-parallel layers of the Llama family (Megatron's split), each an nn.Module with the [out, in]
`.weight` (and `.bias`) of nn.Linear / nn.Embedding, holding only this rank's shard.

ParallelLinear is the common base: find every linear layer of a built model with
`isinstance(m, ParallelLinear)` (a quantized variant may replace one by its weights). At tp_size 1
each layer runs exactly nn.Linear's / nn.Embedding's op on the full weight, so single-rank outputs
are bit-identical to plain torch layers, until `use_onednn` reorders a float32 CPU weight for oneDNN
(models/onednn_linear.py): the same product, summed in oneDNN's order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stepahead.distributed.comm import tp_all_gather_last_dim, tp_all_reduce
from stepahead.distributed.state import SINGLE, ParallelState
from stepahead.models import onednn_linear
from stepahead.models.quant.prompt_rows import PromptRows
from stepahead.utils import cdiv


class ParallelLinear(nn.Linear):
    """nn.Linear over this rank's shard (which rows or columns: the model's load_weights decides).

    Every projection of the model takes (x, prompt_rows): packed replacements run prompt rows on
    other weights (models/quant/prompt_rows.py); a dense layer runs every row the same way and ignores it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ps: ParallelState = SINGLE) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.ps = ps

    def forward(self, x: torch.Tensor, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        return onednn_linear.linear(x, self.weight, self.bias)

    def use_onednn(self) -> None:
        """Hold the weight in oneDNN's layout instead of the plain one (float32 on CPU, after loading)."""
        self.weight = nn.Parameter(onednn_linear.reorder(self.weight), requires_grad=False)


class ColumnParallelLinear(ParallelLinear):
    """Output features split across the stage's ranks; each rank keeps its slice of the output (no comm)."""


class RowParallelLinear(ParallelLinear):
    """Input features split across ranks; the partial products are summed with an all-reduce.
    The bias (if any) is added once, after the sum."""

    def forward(self, x: torch.Tensor, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        if self.ps.tp_size == 1:
            return onednn_linear.linear(x, self.weight, self.bias)
        out = tp_all_reduce(onednn_linear.linear(x, self.weight, None), self.ps)
        return out if self.bias is None else out + self.bias


def vocab_shard(vocab_size: int, ps: ParallelState) -> tuple[int, int]:
    """(first id, ids per rank) of this rank's slice of the vocabulary; the last slice is padded."""
    per_rank = cdiv(vocab_size, ps.tp_size)
    return ps.tp_rank * per_rank, per_rank


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split across ranks: each looks up the ids it holds, zeroes the rest, all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, ps: ParallelState = SINGLE) -> None:
        super().__init__()
        self.ps = ps
        self.vocab_size = vocab_size
        self.vocab_start, per_rank = vocab_shard(vocab_size, ps)
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(out, self.ps)


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary slice, gathered across ranks into the full [T, vocab_size] row.

    `weight` is its own shard, or the tied embedding's (same split)."""

    def __init__(self, vocab_size: int, hidden_size: int, ps: ParallelState = SINGLE,
                 tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.ps = ps
        self.vocab_size = vocab_size
        self._tied = [tied] if tied is not None else []  # a list: not registered as a submodule twice
        if tied is None:
            self.weight = nn.Parameter(torch.empty(vocab_shard(vocab_size, ps)[1], hidden_size))
        self.onednn_weight: torch.Tensor | None = None  # a tied shard's copy in oneDNN's layout (use_onednn)

    def shard_weight(self) -> torch.Tensor:
        return self._tied[0].weight if self._tied else self.weight

    def use_onednn(self) -> None:
        """Multiply by a copy of the shard in oneDNN's layout (float32 on CPU, after loading). A tied
        head keeps the embedding's plain weight for the lookup, so the copy costs its size again."""
        if self._tied:
            self.onednn_weight = onednn_linear.reorder(self.shard_weight())
        else:
            self.weight = nn.Parameter(onednn_linear.reorder(self.weight), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.onednn_weight if self.onednn_weight is not None else self.shard_weight()
        logits = onednn_linear.linear(hidden, weight, None)
        if self.ps.tp_size == 1:
            return logits
        return tp_all_gather_last_dim(logits, self.ps)[..., : self.vocab_size]
