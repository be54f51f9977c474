"""The Llama family in one implementation: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm).

Forward takes the flattened tokens of a mixed prefill + decode batch, their positions, the paged KV
cache and the step's attention metadata (built by the runner's attention backend); it returns hidden states, and compute_logits maps the rows
that sample to vocabulary logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stepahead.attention import paged_attention
from stepahead.attention.paged_cache import PagedKVCache

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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

    @staticmethod
    def from_hf_config(arch: str, cfg: dict) -> LlamaArgs:
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
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
        )


def rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse frequencies with the family's rope scaling applied (float64 for exactness)."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).double() / d))
    kind = rope_type(args.rope_scaling)
    s = args.rope_scaling or {}
    if kind == "linear":
        inv = inv / float(s["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_len = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv = torch.where(medium, smoothed, scaled)
    elif kind != "default":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return inv


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; cos/sin [T, 1, hd] (rotate-half convention, as in HF checkpoints)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size, self.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.qkv_proj = nn.Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.scale = a.head_dim ** -0.5

    def forward(self, x, cos, sin, kv, meta) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = paged_attention(q, k, v.contiguous(), kv, meta, self.scale)
        return self.o_proj(o.view(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.inter = a.intermediate_size
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(g) * u)


class DecoderLayer(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, h, cos, sin, kv, meta):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.args = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = None if a.tie_word_embeddings else nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.rope_cache: torch.Tensor | None = None  # [max_pos, 2, hd]: cos, sin

    def init_rope(self, max_positions: int, dtype: torch.dtype, device) -> None:
        pos = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(pos, rope_inv_freq(self.args))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cache = torch.stack((emb.cos(), emb.sin()), dim=1).to(dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cs = self.rope_cache.index_select(0, positions)  # [T, 2, hd]
        cos, sin = cs[:, 0:1], cs[:, 1:2]
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache.layer(i), meta)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        """weights: iterable of (HF name, tensor). Fuses q/k/v and gate/up as they arrive."""
        a = self.args
        params = dict(self.named_parameters())
        seen: set[str] = set()
        qkv_off = {"q_proj": 0, "k_proj": a.num_heads * a.head_dim,
                   "v_proj": a.num_heads * a.head_dim + a.num_kv_heads * a.head_dim}
        for name, w in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            target, offset = name, None
            for proj, off in qkv_off.items():
                if f"self_attn.{proj}." in name:
                    target, offset = name.replace(proj, "qkv_proj"), off
            for proj, off in (("gate_proj", 0), ("up_proj", a.intermediate_size)):
                if f"mlp.{proj}." in name:
                    target, offset = name.replace(proj, "gate_up_proj"), off
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {a.architecture}")
            p = params[target]
            dst = p if offset is None else p.narrow(0, offset, w.shape[0])
            if tuple(dst.shape) != tuple(w.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(w.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(w)
            seen.add(name)
        missing = [n for n in self.expected_weight_names() if n not in seen]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")

    def expected_weight_names(self) -> list[str]:
        names = []
        for n, _ in self.named_parameters():
            if ".qkv_proj." in n:
                names += [n.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
            elif ".gate_up_proj." in n:
                names += [n.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
            else:
                names.append(n)
        return names
