"""A GGUF file written from a tiny safetensors model, the way llama.cpp's converter lays it out."""

from __future__ import annotations

import json
import math

import numpy as np


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (written independently for the test)."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# HF expert matrix (Qwen3-MoE's and Mixtral's names) -> llama.cpp's stacked experts tensor
_EXPERT_KINDS = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                 "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


def _stack_experts(sd: dict) -> dict:
    """The state dict with each layer's expert matrices stacked into [E, rows, cols] tensors named
    model.layers.N.<llama.cpp kind> (E in expert order), and routers named mlp.gate."""
    import torch

    out, experts = {}, {}
    for name, t in sd.items():
        parts = name.replace("block_sparse_moe.", "mlp.").split(".")
        if parts[3:5] == ["mlp", "experts"]:
            experts.setdefault((parts[2], _EXPERT_KINDS[parts[6]]), {})[int(parts[5])] = t
        else:
            out[".".join(parts)] = t
    for (layer, kind), by_expert in experts.items():
        out[f"model.layers.{layer}.{kind}.weight"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


# The HF layer names, and Gemma's, as llama.cpp's converter names them.
LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down",
               # Phi-3: the checkpoint's fused projections, kept fused (gate_up as llama.cpp's ffn_up)
               "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               # a mixture of experts' router and stacked experts (_stack_experts)
               "mlp.gate": "ffn_gate_inp", **{kind: kind for kind in _EXPERT_KINDS.values()}}
GEMMA_LAYER_NAMES = {**LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                     "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def _gemma_metadata(w, cfg: dict, arch: str) -> None:
    """What llama.cpp's Gemma 2 / Gemma 3 converters write beyond Llama's keys."""
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_sliding_window(cfg["sliding_window"])
    if cfg.get("attn_logit_softcapping") is not None:
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if cfg.get("final_logit_softcapping") is not None:
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma3":
        full = cfg["rope_parameters"]["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf_rope_linear())
            w.add_rope_scaling_factor(full["factor"])
        # the converter writes no pattern; llama.cpp's default (five windowed layers in six) does not
        # fit a two-layer model, so this file says which layers are windowed
        w.add_sliding_window_pattern([kind == "sliding_attention" for kind in cfg["layer_types"]])


def gguf_rope_linear():
    import gguf

    return gguf.RopeScalingType.LINEAR


def _add_phi3_metadata(w, cfg: dict) -> None:
    """What llama.cpp's converter writes for Phi3ForCausalLM beyond the Llama keys: the rotary
    dimensions, the original context, the sliding window (0: none) and LongRoPE's factor tensors with
    their attention factor."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    original = cfg["original_max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope.get("rope_type") == "longrope":
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def write_gguf(folder, path, quant: dict[str, str] | None = None, arch: str | None = None):
    """The tiny safetensors model at folder as a GGUF file at path (no tokenizer metadata).

    quant maps a GGUF tensor kind ("attn_q", "ffn_down", "output", ...) to the GGUF type it is
    written in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "F16", or a k-quant "Q4_K", "Q5_K", "Q6_K" through
    tests/models/kquant_blocks.py); other tensors are f32. arch None: from the config (Llama as `llama`,
    Mixtral as `llama` with experts, Qwen3-MoE as `qwen3moe`, Phi-3 as `phi3`); "gemma2" / "gemma3":
    Gemma's metadata, tensor names and norm weights stored as 1 + w, as llama.cpp's converter writes them."""
    import gguf
    import gguf.quants
    from safetensors.torch import load_file

    from tests.models.kquant_blocks import BLOCK_BYTES, quantize_kquant

    cfg = json.loads((folder / "config.json").read_text())
    sd = _stack_experts(load_file(str(folder / "model.safetensors")))
    if arch is None:
        arch = {"Phi3ForCausalLM": "phi3", "Qwen3MoeForCausalLM": "qwen3moe"}.get(cfg["architectures"][0], "llama")
    gemma = arch in ("gemma2", "gemma3")
    w = gguf.GGUFWriter(str(path), arch)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if gemma:
        _gemma_metadata(w, cfg, arch)
    else:
        w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_eos_token_id(2)
    if arch == "phi3":
        _add_phi3_metadata(w, cfg)
    elif (cfg.get("rope_parameters") or {}).get("rope_type") == "yarn":  # as llama.cpp's converter writes it
        rope = cfg["rope_parameters"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    names = GEMMA_LAYER_NAMES if gemma else LAYER_NAMES
    for name, t in sd.items():
        a = t.float().numpy()
        if gemma and name.endswith("norm.weight"):
            a = a + np.float32(1.0)
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            base, kind = ".".join(rest[:-1]), rest[-1]
            if base == "self_attn.q_proj" and arch == "llama":
                a = _llamacpp_permute(a, cfg["num_attention_heads"])
            elif base == "self_attn.k_proj" and arch == "llama":
                a = _llamacpp_permute(a, cfg["num_key_value_heads"])
            gname = f"blk.{i}.{names[base]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        kind_name = gname.split(".")[-2]
        if quant and kind_name in quant:
            qtype = getattr(gguf.GGMLQuantizationType, quant[kind_name])
            if quant[kind_name] == "F16":
                w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float16))
            elif quant[kind_name] in BLOCK_BYTES:
                w.add_tensor(gname, quantize_kquant(a, quant[kind_name]), raw_dtype=qtype)
            else:
                w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
