"""Gemma 2 and Gemma 3 (text): the Llama family's projections, shards and weight loading
(models/llama.py) with Gemma's own pieces around them.

- RMSNorms scale by (1 + weight), in float32 whatever the model's dtype; four per layer: before and
  after attention, before and after the MLP.
- The MLP is GeGLU: gelu (tanh approximation) of the gate times up.
- Embeddings are multiplied by sqrt(hidden_size) rounded to the model's dtype; the head is tied.
- Attention scales by query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps attention logits, both may
  soft-cap the final logits.
- Local (windowed) and global layers alternate (models/windows.py); Gemma 3 normalizes q and k per
  head and rotates its local layers with their own rope base (rope_local_base_freq).

stepahead's CPU kernels run the rope (Gemma 2), the norms (with the 1 + weight folded in) and the
attention; DecodeStack and the fused Triton norm kernels are left off (they compute Llama's norms).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stepahead.attention.paged_cache import PagedKVCache
from stepahead.distributed.state import SINGLE, ParallelState
from stepahead.kernels import cpu_ops
from stepahead.models import llama
from stepahead.models.llama_args import LlamaArgs
from stepahead.models.quant.prompt_rows import PromptRows
from stepahead.models.rope import rope_cos_sin, rope_type
from stepahead.models.windows import layer_windows

SUPPORTED_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass
class GemmaArgs(LlamaArgs):
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None  # Gemma 3's local layers' rope base (None: the global one)

    @staticmethod
    def from_hf_config(arch: str, cfg: dict) -> GemmaArgs:
        activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if activation not in GELU_TANH:
            raise ValueError(f"hidden_activation {activation!r} is not supported for {arch} "
                             f"(supported: {', '.join(GELU_TANH)})")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"use_bidirectional_attention is not supported for {arch} (a causal LM is)")
        base = LlamaArgs.from_hf_config("LlamaForCausalLM", cfg)
        theta, scaling, local_theta = _rope_bases(arch, cfg, base.rope_theta, base.rope_scaling)
        heads = cfg["num_attention_heads"]
        return GemmaArgs(**{
            **dataclasses.asdict(base),
            "architecture": arch,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "rope_theta": theta,
            "rope_scaling": scaling,
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
            "qk_norm": arch == "Gemma3ForCausalLM",
            "sliding_windows": layer_windows(arch, cfg, cfg["num_hidden_layers"]),
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
            "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
            "final_logit_softcapping": cfg.get("final_logit_softcapping"),
            "local_rope_theta": local_theta,
        })

    def local_rope(self) -> GemmaArgs:
        """The rope of the windowed layers: Gemma 3's local base, no scaling (the global rope's
        scaling applies to global layers only)."""
        if self.local_rope_theta is None:
            return self
        return dataclasses.replace(self, rope_theta=self.local_rope_theta, rope_scaling=None)


def _rope_bases(arch: str, cfg: dict, theta: float,
                scaling: dict | None) -> tuple[float, dict | None, float | None]:
    """(global base, global scaling, local base or None): Gemma 3 configs hold them per layer kind in
    rope_parameters, or, as older checkpoints do, as rope_theta / rope_scaling / rope_local_base_freq."""
    if arch != "Gemma3ForCausalLM":
        return theta, scaling, None
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = dict(params["full_attention"] or {}), dict(params.get("sliding_attention") or {})
        if rope_type(local) != "default":
            raise ValueError(f"rope_parameters.sliding_attention type {rope_type(local)!r} is not supported "
                             "(supported: default)")
        return float(full.get("rope_theta", 1_000_000.0)), full, float(local.get("rope_theta", 10_000.0))
    return (float(cfg.get("rope_theta", 1_000_000.0)), cfg.get("rope_scaling"),
            float(cfg.get("rope_local_base_freq", 10_000.0)))


class GemmaRMSNorm(llama.RMSNorm):
    """x / rms(x) * (1 + weight), computed in float32 and returned in x's dtype (as transformers and
    vLLM compute it); the checkpoint's weight is the offset from 1."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.gain: torch.Tensor | None = None  # 1 + weight in float32, made on first use (after loading)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gain is None:
            self.gain = self.weight.float() + 1.0
        if self.kernel:  # float32 on CPU: stepahead's kernel over the gain
            return cpu_ops.rms_norm(x, self.gain, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.gain, self.eps).to(x.dtype)


class GemmaAttention(llama.Attention):
    def __init__(self, a: GemmaArgs, ps: ParallelState = SINGLE, window: int | None = None) -> None:
        super().__init__(a, ps, window)
        self.scale = a.query_pre_attn_scalar ** -0.5
        self.softcap = a.attn_logit_softcapping
        if a.qk_norm:
            self.q_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps)


class GemmaMLP(llama.MLP):
    def forward(self, x: torch.Tensor, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        g, u = self.gate_up_proj(x, prompt_rows).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.gelu(g, approximate="tanh") * u, prompt_rows)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, a: GemmaArgs, ps: ParallelState = SINGLE, window: int | None = None, index: int = 0) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(a, ps, window)
        self.mlp = GemmaMLP(a, ps)
        self.input_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, h, cos_sin, kv, meta, prompt_rows: PromptRows | None = None):
        attn = self.self_attn(self.input_layernorm(h), cos_sin, kv, meta, prompt_rows)
        h = h + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(h), prompt_rows)
        return h + self.post_feedforward_layernorm(mlp)


class GemmaForCausalLM(llama.LlamaForCausalLM):
    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, a: GemmaArgs, ps: ParallelState = SINGLE) -> None:
        super().__init__(a, ps)
        self.args: GemmaArgs = a
        self.local_rope_cache: torch.Tensor | None = None  # Gemma 3's local layers' rows (None: the global ones)

    def use_cpu_kernels(self) -> None:
        super().use_cpu_kernels()
        self.decode_stack = None  # DecodeStack computes Llama's layer

    def use_triton_fused(self) -> None:
        """Left off: the fused kernels compute Llama's norms (weight, not 1 + weight)."""

    def init_rope(self, max_positions: int, dtype: torch.dtype, device) -> None:
        super().init_rope(max_positions, dtype, device)
        if self.args.local_rope_theta is not None:
            self.local_rope_cache = rope_cos_sin(self.args.local_rope(), max_positions, dtype, device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, "only the first stage embeds"
        h = self.embed_tokens(input_ids)
        # sqrt(hidden_size) rounded to the model's dtype first, as the checkpoints were trained with
        return h * float(torch.tensor(self.args.hidden_size ** 0.5, dtype=h.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta, hidden: torch.Tensor | None = None, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """As LlamaForCausalLM.forward; windowed layers take the local rope's rows where there is one."""
        assert self.rope_cache is not None, "init_rope() first"
        h = self.stage_input(input_ids, hidden)
        global_rows = self.rope_cache.index_select(0, positions)
        local_rows = global_rows
        if self.local_rope_cache is not None:
            local_rows = self.local_rope_cache.index_select(0, positions)
        for i, layer in enumerate(self.layers):
            windowed = self.args.window_of(self.layer_range.start + i) is not None
            h = layer(h, local_rows if windowed else global_rows, kv_cache.layer(i), meta, prompt_rows)
        if self.norm is None:  # not the last stage: the residual stream goes on
            return h
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only the last stage computes logits"
        logits = self.lm_head(hidden)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
