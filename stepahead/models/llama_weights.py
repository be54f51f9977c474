"""How a checkpoint in the Llama layout loads into the model at one rank: checkpoint names in the
model's terms (Mixtral's experts), the part of each tensor this rank reads (ShardRead: its heads, its
slice of the MLP, its vocabulary rows; the layers of its pipeline stage only), and q/k/v and gate/up
fused into the model's projections as they arrive.

LlamaForCausalLM (models/llama.py) inherits the loading from CheckpointLoading; a family whose
checkpoint fuses projections already (models/phi3.py) overrides shard_reads.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from torch import nn

from stepahead.distributed.state import ParallelState
from stepahead.models.llama_args import LlamaArgs, RankShard
from stepahead.models.loading.weights import as_handle
from stepahead.models.parallel_layers import VocabParallelEmbedding, vocab_shard

# Mixtral's checkpoint names for the MoE block and its experts' matrices -> Qwen3-MoE's, which the model uses.
_MIXTRAL_NAMES = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                  (".w2.", ".down_proj."))
_EXPERT_WEIGHT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor's name in the model's terms (Mixtral's block_sparse_moe.experts.E.w1 ->
    mlp.experts.E.gate_proj, ...); other names as they are."""
    if "block_sparse_moe." in name:
        for old, new in _MIXTRAL_NAMES:
            name = name.replace(old, new)
    return name


def _expert_of(name: str) -> tuple[int | None, str]:
    """(expert index, the name without it) for one expert's matrix (layers.0.mlp.experts.3.up_proj.weight ->
    3, layers.0.mlp.experts.up_proj.weight); (None, name) for any other weight."""
    m = _EXPERT_WEIGHT.search(name)
    if m is None:
        return None, name
    return int(m.group(1)), name[:m.start()] + ".mlp.experts." + name[m.end():]


class ShardRead(NamedTuple):
    """The part of a checkpoint tensor a rank loads: `length` entries from `start` along `dim` (where
    the checkpoint holds `full`), into the parameter's rows from `offset` (None: the whole parameter).
    A checkpoint tensor that fuses projections (Phi-3's qkv_proj) takes one read per part."""

    offset: int | None
    dim: int
    start: int
    length: int
    full: int


class CheckpointLoading(nn.Module):
    """load_weights and the reads behind it, for a model that holds the attributes below (set in its
    __init__): its arguments, its rank, its shard of each layer, the global indices of its stage's
    layers and its embedding (None on a stage without one)."""

    args: LlamaArgs
    ps: ParallelState
    shard: RankShard
    layer_range: range
    embed_tokens: VocabParallelEmbedding | None

    def part_reads(self) -> dict[str, ShardRead]:
        """This rank's read of each projection as a checkpoint tensor of its own (q_proj, ..., down_proj),
        into its rows of the model's (fused) projection."""
        a, shard, ps = self.args, self.shard, self.ps
        hd, inter = a.head_dim, shard.intermediate_size
        q_local, kv_local = shard.num_heads * hd, shard.num_kv_heads * hd
        q_all, kv_all = a.num_heads * hd, a.num_kv_heads * hd
        q_start, kv_start, inter_start = ps.tp_rank * q_local, shard.kv_head_start * hd, ps.tp_rank * inter
        return {
            "q_proj": ShardRead(0, 0, q_start, q_local, q_all),
            "k_proj": ShardRead(q_local, 0, kv_start, kv_local, kv_all),
            "v_proj": ShardRead(q_local + kv_local, 0, kv_start, kv_local, kv_all),
            "gate_proj": ShardRead(0, 0, inter_start, inter, a.intermediate_size),
            "up_proj": ShardRead(inter, 0, inter_start, inter, a.intermediate_size),
            "o_proj": ShardRead(None, 1, q_start, q_local, q_all),
            "down_proj": ShardRead(None, 1, inter_start, inter, a.intermediate_size),
        }

    def shard_reads(self) -> dict[str, tuple[str, tuple[ShardRead, ...]]]:
        """checkpoint projection -> (the model's projection it loads into, this rank's reads of it):
        Llama checkpoints hold q/k/v and gate/up apart, and the model fuses them."""
        fused = {"q_proj": "self_attn.qkv_proj", "k_proj": "self_attn.qkv_proj", "v_proj": "self_attn.qkv_proj",
                 "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_up_proj", "up_proj": "mlp.gate_up_proj",
                 "down_proj": "mlp.down_proj"}
        reads = {f"{fused[part].split('.')[0]}.{part}.": (f"{fused[part]}.", (read,))
                 for part, read in self.part_reads().items()}
        return {**reads, **self.expert_reads()}

    def expert_reads(self) -> dict[str, tuple[str, tuple[ShardRead, ...]]]:
        """One expert's matrices (a checkpoint tensor each), into its row of the stacked [E, ...]
        parameters: this rank's slice of the expert's intermediate features."""
        a, ps = self.args, self.ps
        if a.moe is None:
            return {}
        full = a.moe.intermediate_size
        local = full // ps.tp_size
        start = ps.tp_rank * local
        return {"mlp.experts.gate_proj.": ("mlp.experts.gate_up_proj.", (ShardRead(0, 0, start, local, full),)),
                "mlp.experts.up_proj.": ("mlp.experts.gate_up_proj.", (ShardRead(local, 0, start, local, full),)),
                "mlp.experts.down_proj.": ("mlp.experts.down_proj.", (ShardRead(None, 1, start, local, full),))}

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        """weights: iterable of (HF name, tensor or WeightHandle). Fuses q/k/v and gate/up as they arrive
        (shard_reads), reading only this rank's shard of each and nothing of the layers other stages hold."""
        a, ps = self.args, self.ps
        params = dict(self.named_parameters())
        split = self.shard_reads()
        seen: set[str] = set()
        for name, w in weights:
            name = checkpoint_name(name.removeprefix("model."))
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and a.tie_word_embeddings:
                continue
            local = self._local_name(name)
            if local is None:  # another stage's
                continue
            handle = as_handle(w)
            expert, of_experts = _expert_of(local)
            target, reads = of_experts, None
            for proj, (fused, proj_reads) in split.items():
                if proj in of_experts:
                    target, reads = of_experts.replace(proj, fused), proj_reads
            if expert is not None:
                target = target.removesuffix(".weight")  # the stacked parameter itself
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {a.architecture}")
            p = params[target]
            if expert is not None:
                if expert >= p.shape[0]:
                    raise ValueError(f"weight {name!r}: expert {expert} of a model with {p.shape[0]} experts")
                p = p[expert]
            if local in ("embed_tokens.weight", "lm_head.weight"):
                vocab_start, _ = vocab_shard(a.vocab_size, ps)
                rows = max(0, min(p.shape[0], handle.shape[0] - vocab_start))
                p[rows:].zero_()  # the padding of the last vocabulary slice
                reads = (ShardRead(0, 0, vocab_start, rows, a.vocab_size),)
            for read in reads or (None,):
                self._load_part(name, handle, p, read)
            seen.add(local)
        missing = [n for n in self.expected_weight_names() if n not in seen]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")

    def _load_part(self, name: str, handle, p: torch.Tensor, read: ShardRead | None) -> None:
        """Copy one read of a checkpoint tensor (None: all of it) into its rows of parameter p."""
        dst = p if read is None or read.offset is None else p.narrow(0, read.offset, read.length)
        expected = tuple(dst.shape)
        if read is None:
            ok = tuple(handle.shape) == expected
        else:
            shape = list(handle.shape)
            ok = len(shape) > read.dim and shape[read.dim] == read.full
            if ok:
                shape[read.dim] = read.length
            ok = ok and tuple(shape) == expected
        if not ok:
            of_rank = f" (rank {self.ps.rank}'s part)" if self.ps.world_size > 1 else ""
            raise ValueError(f"weight {name!r} has shape {tuple(handle.shape)}, expected {expected}{of_rank}")
        whole = read is None or (read.start == 0 and read.length == handle.shape[read.dim])
        dst.copy_(handle.load() if whole else handle.narrow(read.dim, read.start, read.length))

    def _local_name(self, name: str) -> str | None:
        """The checkpoint name with this stage's layer index, or None for a weight this stage does not hold."""
        if name.startswith("layers."):
            index, _, rest = name[len("layers."):].partition(".")
            i = int(index)
            if i not in self.layer_range:
                return None
            return f"layers.{i - self.layer_range.start}.{rest}"
        if name.startswith("embed_tokens.") and self.embed_tokens is None:
            return None
        if (name.startswith("norm.") or name.startswith("lm_head.")) and not self.ps.is_last_stage:
            return None
        return name

    def expected_weight_names(self) -> list[str]:
        """The checkpoint's names (this stage's layer numbering) of every tensor the model loads."""
        sources: dict[str, list[str]] = {}
        for proj, (fused, _) in self.shard_reads().items():
            sources.setdefault(fused, []).append(proj)
        names = []
        for n, p in self.named_parameters():
            if n.endswith(".experts.gate_up_proj") or n.endswith(".experts.down_proj"):
                stem, _, fused_name = n.rpartition(".")
                parts = ("gate_proj", "up_proj") if fused_name == "gate_up_proj" else ("down_proj",)
                names += [f"{stem}.{e}.{part}.weight" for e in range(p.shape[0]) for part in parts]
                continue
            fused = next((f for f in sources if f in n), None)
            names += [n] if fused is None else [n.replace(fused, proj) for proj in sources[fused]]
        return names
