"""The Llama family in one implementation: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm),
and the mixtures of experts built on it (Qwen3-MoE, Mixtral: LlamaArgs.moe, the MLP of their sparse layers
a models/moe.py MoeBlock; their arguments in models/moe_families.py).

Forward takes the flattened tokens of a mixed prefill + decode batch, their positions, the paged KV
cache and the step's attention metadata (built by the runner's attention backend); it returns hidden states, and compute_logits maps the rows
that sample to vocabulary logits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from stepahead.attention import paged_attention
from stepahead.attention.paged_cache import PagedKVCache
from stepahead.attention.sdpa import AttentionMetadata
from stepahead.distributed.layer_partition import stage_layer_range
from stepahead.distributed.state import SINGLE, ParallelState
from stepahead.kernels import cpu_ops
from stepahead.kernels.cpu_decode_stack import new_decode_stack
from stepahead.models.loading.weights import as_handle
from stepahead.models.moe import DenseExperts, MoeArgs, MoeBlock
from stepahead.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_shard,
)
from stepahead.models.quant.prompt_rows import PromptRows
from stepahead.models.quant.quantized_linear import packed_tiles
from stepahead.models.rope import apply_rope, rope_cos_sin
from stepahead.models.windows import layer_windows

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = False  # stepahead's CPU kernel: torch's arithmetic, bitwise, in one call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


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


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs, ps: ParallelState = SINGLE, window: int | None = None) -> None:
        super().__init__()
        self.window = window  # tokens this layer attends to (its own included); None: the whole context
        self.softcap: float | None = None  # attention logit soft-capping (a family that has it sets it)
        shard = RankShard.of(a, ps)
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, a.head_dim
        self.q_size, self.kv_size = self.num_heads * a.head_dim, self.num_kv_heads * a.head_dim
        self.qkv_proj = ColumnParallelLinear(a.hidden_size, self.q_size + 2 * self.kv_size, a.qkv_bias, ps)
        self.o_proj = RowParallelLinear(self.q_size, a.hidden_size, False, ps)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.scale = a.head_dim ** -0.5
        self.kernel = False  # rope by stepahead's CPU kernel (LlamaForCausalLM.use_cpu_kernels)
        self.fused_rope = None  # CUDA: triton_fused.rope_qk_norm_ (LlamaForCausalLM.use_triton_fused)

    def forward(self, x, cos_sin, kv, meta, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """cos_sin [T, 2, rotary dim]: each token's rope rows."""
        t = x.shape[0]
        heads = self.qkv_proj(x, prompt_rows).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk_heads, v = heads.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        # q and k sit side by side in the fused projection: one rope over both halves the ops.
        if self.fused_rope is not None:  # q/k norms and rope in one kernel, in place
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm is not None else ()
            self.fused_rope(qk_heads, cos_sin, self.num_heads, *norms)
            q, k = qk_heads.split([self.num_heads, self.num_kv_heads], dim=1)
        elif self.q_norm is None and self.kernel:
            cpu_ops.rotary_embedding_(qk_heads, cos_sin)  # in place: the projection's output is ours
            q, k = qk_heads.split([self.num_heads, self.num_kv_heads], dim=1)
        elif self.q_norm is None:
            cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]
            q, k = apply_rope(qk_heads, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]
            q, k = qk_heads.split([self.num_heads, self.num_kv_heads], dim=1)
            q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        o = paged_attention(q, k, v, kv, meta, self.scale, self.window, self.softcap)
        return self.o_proj(o.view(t, self.q_size), prompt_rows)


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs, ps: ParallelState = SINGLE) -> None:
        super().__init__()
        self.inter = a.intermediate_size // ps.tp_size
        self.gate_up_proj = ColumnParallelLinear(a.hidden_size, 2 * self.inter, False, ps)
        self.down_proj = RowParallelLinear(self.inter, a.hidden_size, False, ps)
        self.kernel = False  # silu(gate) * up by stepahead's CPU kernel (LlamaForCausalLM.use_cpu_kernels)

    def forward(self, x: torch.Tensor, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, prompt_rows)
        if self.kernel:
            return self.down_proj(cpu_ops.silu_mul(gate_up), prompt_rows)
        g, u = gate_up.split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(g) * u, prompt_rows)


class DecoderLayer(nn.Module):
    def __init__(self, a: LlamaArgs, ps: ParallelState = SINGLE, window: int | None = None, index: int = 0) -> None:
        """window: the layer's attention window; index: its global index (which decides whether its MLP
        is a MoE block)."""
        super().__init__()
        self.self_attn = Attention(a, ps, window)
        self.mlp: MLP | MoeBlock = MoeBlock(a.hidden_size, a.moe, ps) if a.moe and a.is_sparse(index) else MLP(a, ps)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.fused_add_norm = None  # CUDA: triton_fused.add_rms_norm (LlamaForCausalLM.use_triton_fused)

    def forward(self, h, cos_sin, kv, meta, prompt_rows: PromptRows | None = None):
        attn = self.self_attn(self.input_layernorm(h), cos_sin, kv, meta, prompt_rows)
        if self.fused_add_norm is not None:  # the residual add and the norm in one kernel
            norm = self.post_attention_layernorm
            h, normed = self.fused_add_norm(h, attn, norm.weight, norm.eps)
        else:
            h = h + attn
            normed = self.post_attention_layernorm(h)
        return h + self.mlp(normed, prompt_rows)


def build_decode_stack(model):
    """A DecodeStack (kernels/cpu_decode_stack.py) over the model's layers, or None unless every
    projection of every layer runs stepahead's packed kernel, in any of its formats (Q4, Q5, Q8, the
    k-quants; each projection its own, or its parts side by side in theirs: PackedParts); torch's
    kernels, dense projections, Qwen3's per-head norms, rope over part of each head, sliding windows or
    soft-capped attention, mixtures of experts, tensor or pipeline ranks: those steps keep the Python path."""
    args = model.args
    if (model.ps.world_size > 1 or args.qk_norm or args.partial_rotary_factor != 1.0
            or getattr(args, "moe", None) is not None or not model.layers):
        return None
    if any(layer.self_attn.window is not None or layer.self_attn.softcap is not None for layer in model.layers):
        return None
    layers, parts = [], []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        counts = []
        for p in projections:
            tiles = packed_tiles(p)
            if tiles is None:
                return None
            tensors += [*tiles, p.bias if p.bias is not None else torch.empty(0)]
            counts.append(len(tiles))
        layers.append(tensors)
        parts.append(counts)
    attn = model.layers[0].self_attn
    return new_decode_stack(layers, parts, attn.num_heads, attn.num_kv_heads, attn.head_dim, args.rms_norm_eps,
                            attn.scale, args.hidden_size)


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


class LlamaForCausalLM(nn.Module):
    """The whole model at one rank, or one rank's part of it: with tensor parallelism every layer holds
    its shard (RankShard); with pipeline parallelism the stage holds the layers stage_layers() names, the
    first stage the embedding, the last the final norm and LM head (and the embedding when tied).

    A family that shares the weight layout and loading (models/gemma.py) brings its own layer and norm
    classes and overrides embed() and forward()."""

    layer_class: type[nn.Module] = DecoderLayer  # built as layer_class(args, ps, window, global index)
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, a: LlamaArgs, ps: ParallelState = SINGLE) -> None:
        super().__init__()
        self.args = a
        self.ps = ps
        self.layer_range = stage_layers(a.num_layers, ps)
        self.shard = RankShard.of(a, ps)
        has_embedding = ps.is_first_stage or (ps.is_last_stage and a.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, ps) if has_embedding else None
        self.layers = nn.ModuleList(self.layer_class(a, ps, a.window_of(i), i) for i in self.layer_range)
        self.norm = self.norm_class(a.hidden_size, a.rms_norm_eps) if ps.is_last_stage else None
        self.lm_head = None
        if ps.is_last_stage:
            self.lm_head = ParallelLMHead(a.vocab_size, a.hidden_size, ps,
                                          tied=self.embed_tokens if a.tie_word_embeddings else None)
        self.rope_cache: torch.Tensor | None = None  # [max_pos, 2, rotary dim]: cos, sin
        self.cpu_kernels = False  # whether rope, norms, activations, decode attention run stepahead's CPU kernels
        self.decode_stack = None  # the layers as one C++ call for decode-only steps (kernels/cpu_decode_stack.py)
        self.dense_prompt_rows = False  # whether packed projections run prompt rows dense (models/quant/prompt_rows.py)

    def use_cpu_kernels(self) -> None:
        """Run rope, the MLP's activation and the norms (where the norm kernel is torch's arithmetic), and
        ask the runner to run decode attention, on stepahead's CPU kernels, and decode-only steps through
        DecodeStack where every projection allows (the loader's choice for float32 on CPU)."""
        for module in self.modules():
            if isinstance(module, (Attention, MLP)):
                module.kernel = True
            elif isinstance(module, RMSNorm):
                module.kernel = cpu_ops.rms_norm_is_torchs(module.weight.shape[0])
        self.cpu_kernels = True
        self.decode_stack = build_decode_stack(self)

    def use_triton_fused(self) -> None:
        """Run each layer's q/k norms and rope, and its residual add with the following norm, as one
        Triton kernel each (attention/triton_fused.py): the runner's choice on CUDA."""
        from stepahead.attention import triton_fused

        full_rotary = self.args.partial_rotary_factor == 1.0  # the kernel rotates whole heads
        for module in self.modules():
            if isinstance(module, Attention) and full_rotary:
                module.fused_rope = triton_fused.rope_qk_norm_
            elif isinstance(module, DecoderLayer):
                module.fused_add_norm = triton_fused.add_rms_norm

    def use_onednn(self) -> None:
        """Run the dense projections and the head through oneDNN (models/onednn_linear.py), their
        weights reordered once; for float32 on CPU, once loading is done (the runner's choice: the
        plain weights are gone after it)."""
        for module in self.modules():
            if isinstance(module, ParallelLinear):
                module.use_onednn()
        if isinstance(self.lm_head, ParallelLMHead):
            self.lm_head.use_onednn()

    def can_capture_graphs(self) -> bool:
        """Whether a decode step runs without waiting on the device, as a CUDA graph needs: not so for
        experts that run one product per expert (they read each expert's row count on the host)."""
        return all(isinstance(m.experts, DenseExperts) and m.experts.runs_grouped()
                   for m in self.modules() if isinstance(m, MoeBlock))

    def init_rope(self, max_positions: int, dtype: torch.dtype, device) -> None:
        self.rope_cache = rope_cos_sin(self.args, max_positions, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta, hidden: torch.Tensor | None = None, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """The first stage embeds input_ids; a later one continues from hidden (the previous stage's
        output; zeros when None, for a memory-profiling dummy step). The last stage returns normed
        hidden states, the others the residual stream to send on. kv_cache holds this stage's layers;
        prompt_rows says which rows are prompt tokens (packed weights on torch's kernels run them
        dense)."""
        h = self.stage_input(input_ids, hidden)
        cos_sin = self.rope_cache.index_select(0, positions)  # [T, 2, rotary dim]
        group = None
        if self.decode_stack is not None and prompt_rows is None and isinstance(meta, AttentionMetadata):
            group = meta.single_decode_group()
        if group is not None:  # the same operators in the same order, from C++
            h = self.decode_stack.forward(h, cos_sin, kv_cache.k, kv_cache.v, group.block_table, group.seq_lens,
                                          meta.slot_mapping)
        else:
            for i, layer in enumerate(self.layers):
                h = layer(h, cos_sin, kv_cache.layer(i), meta, prompt_rows)
        return self.norm(h) if self.ps.is_last_stage else h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def stage_input(self, input_ids: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        """The residual stream this stage starts from: the embedded tokens on the first stage, else the
        previous stage's output (zeros when None, for a memory-profiling dummy step)."""
        if self.ps.is_first_stage:
            return self.embed(input_ids)
        return hidden if hidden is not None else self.rope_cache.new_zeros(input_ids.shape[0], self.args.hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (gathered across tensor ranks); last stage only."""
        return self.lm_head(hidden)

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
