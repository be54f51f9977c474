"""The Llama family in one implementation: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm),
and the mixtures of experts built on it (Qwen3-MoE, Mixtral: LlamaArgs.moe, the MLP of their sparse layers
a models/moe.py MoeBlock; their arguments in models/moe_families.py).

Forward takes the flattened tokens of a mixed prefill + decode batch, their positions, the paged KV
cache and the step's attention metadata (built by the runner's attention backend); it returns hidden states, and compute_logits maps the rows
that sample to vocabulary logits.

This file holds the layers and the model's forward pass. The arguments and how they split over ranks
are in models/llama_args.py; how a checkpoint loads into the model (load_weights, which the model
inherits) is in models/llama_weights.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stepahead.attention import paged_attention
from stepahead.attention.paged_cache import PagedKVCache
from stepahead.attention.sdpa import AttentionMetadata
from stepahead.distributed.state import SINGLE, ParallelState
from stepahead.kernels import cpu_ops
from stepahead.kernels.cpu_decode_stack import new_decode_stack
from stepahead.models.llama_args import LlamaArgs, RankShard, stage_layers
from stepahead.models.llama_weights import CheckpointLoading
from stepahead.models.moe import DenseExperts, MoeBlock
from stepahead.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from stepahead.models.quant.prompt_rows import PromptRows
from stepahead.models.quant.quantized_linear import packed_tiles
from stepahead.models.rope import apply_rope, rope_cos_sin

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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


class LlamaForCausalLM(CheckpointLoading):
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
