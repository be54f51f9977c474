"""The Llama family's arguments (LlamaArgs, read from a Hugging Face config) and how a model of them
splits over ranks: the tensor-parallel shard of a layer (RankShard, check_parallel_sizes) and the
layers of a pipeline stage (stage_layers).
"""

from __future__ import annotations

from dataclasses import dataclass

from stepahead.distributed.layer_partition import stage_layer_range
from stepahead.distributed.state import ParallelState
from stepahead.models.moe import MoeArgs
from stepahead.models.windows import layer_windows


@dataclass
class LlamaArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    partial_rotary_factor: float = 1.0  # the share of each head's features rope rotates (models/rope.py)
    sliding_windows: tuple[int | None, ...] = ()  # each layer's attention window; () for none (models/windows.py)

    moe: MoeArgs | None = None  # experts of the sparse layers (None: every layer's MLP is dense)


    def window_of(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers

    @staticmethod
    def from_hf_config(arch: str, cfg: dict) -> LlamaArgs:
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        if "original_max_position_embeddings" in cfg:  # kept beside rope_scaling by some checkpoints (Phi-3)
            rope.setdefault("original_max_position_embeddings", cfg["original_max_position_embeddings"])
        return LlamaArgs(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope or None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
            sliding_windows=layer_windows(arch, cfg, cfg["num_hidden_layers"]),
        )


@dataclass(frozen=True)
class RankShard:
    """What one rank of a tensor-parallel stage holds of a layer: its query heads, its KV heads (a
    contiguous run of them, or one replicated head when there are fewer KV heads than ranks) and its
    slice of the MLP's intermediate features."""

    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int

    @staticmethod
    def of(a: LlamaArgs, ps: ParallelState) -> RankShard:
        tp, r = ps.tp_size, ps.tp_rank
        if a.num_kv_heads >= tp:
            num_kv, kv_start = a.num_kv_heads // tp, r * (a.num_kv_heads // tp)
        else:
            num_kv, kv_start = 1, r * a.num_kv_heads // tp
        return RankShard(a.num_heads // tp, num_kv, kv_start, a.intermediate_size // tp)


def check_parallel_sizes(a: LlamaArgs, tp: int, pp: int) -> None:
    """Raise ValueError naming the numbers when the model cannot be split tp ways (any pp splits its
    layers, unevenly if need be; engine/arg_utils.check_parallel checks the stages' layer counts)."""
    if a.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide num_attention_heads={a.num_heads}")
    if a.num_kv_heads % tp and tp % a.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={a.num_kv_heads}: one must divide "
                         "the other (KV heads are split across ranks, or replicated when fewer than ranks)")
    if a.intermediate_size % tp and not all(a.is_sparse(i) for i in range(a.num_layers)):
        raise ValueError(f"tensor_parallel_size={tp} does not divide intermediate_size={a.intermediate_size}")
    if a.moe is not None and a.moe.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the experts' intermediate size "
                         f"{a.moe.intermediate_size}")


def stage_layers(num_layers: int, ps: ParallelState) -> range:
    """The global indices of the layers this pipeline stage holds: a contiguous split, uneven where P does
    not divide the layers, or the override's (distributed/layer_partition.py)."""
    return stage_layer_range(num_layers, ps.pp_rank, ps.pp_size, ps.layer_partition)
