"""Qwen3-MoE and Mixtral: the Llama family's model (models/llama.py) whose sparse layers' MLP is a
MoE block (models/moe.py). This module reads their configs into LlamaArgs with `moe` set."""

from __future__ import annotations

import dataclasses

from stepahead.models.llama_args import LlamaArgs
from stepahead.models.moe import MoeArgs

QWEN3_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
MIXTRAL_ARCHITECTURES = ("MixtralForCausalLM",)


def _num_experts(cfg: dict) -> int:
    # transformers writes Qwen3-MoE's num_experts as num_local_experts (its attribute map); older configs
    # and GGUF metadata write num_experts.
    return int(cfg["num_experts"] if cfg.get("num_experts") is not None else cfg["num_local_experts"])


def qwen3_moe_args(arch: str, cfg: dict) -> LlamaArgs:
    """Qwen3's attention (per-head q/k norms); softmax over all experts, then the top k, rescaled to sum
    to one when norm_topk_prob. Layer i is sparse unless listed in mlp_only_layers or (i + 1) is not a
    multiple of decoder_sparse_step; the dense ones use intermediate_size."""
    base = LlamaArgs.from_hf_config(arch, cfg)
    step = int(cfg.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be at least 1, got {step}")
    dense = set(cfg.get("mlp_only_layers") or ())
    moe = MoeArgs(
        num_experts=_num_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]), renormalize=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=tuple(i for i in range(base.num_layers) if i not in dense and (i + 1) % step == 0))
    return dataclasses.replace(base, qk_norm=True, moe=moe)


def mixtral_args(arch: str, cfg: dict) -> LlamaArgs:
    """Mistral's attention; every layer sparse, each expert of intermediate_size; the weights are the
    softmax over the top k logits (the top k probabilities renormalised)."""
    base = LlamaArgs.from_hf_config(arch, cfg)
    moe = MoeArgs(num_experts=_num_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
                  intermediate_size=base.intermediate_size, renormalize=True,
                  sparse_layers=tuple(range(base.num_layers)))
    return dataclasses.replace(base, moe=moe)
