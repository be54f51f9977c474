"""A GGUF file written from a tiny safetensors model, the way llama.cpp's converter lays it out."""

from __future__ import annotations

import json

import numpy as np


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (written independently for the test)."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder, path, quant: dict[str, str] | None = None):
    """The tiny safetensors model at folder as a GGUF file at path (no tokenizer metadata).

    quant maps a GGUF tensor kind ("attn_q", "ffn_down", "output", ...) to the GGUF type it is
    written in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "F16", or a k-quant "Q4_K", "Q5_K", "Q6_K" through
    tests/models/kquant_blocks.py); other tensors are f32."""
    import gguf
    import gguf.quants
    from safetensors.torch import load_file

    from tests.models.kquant_blocks import BLOCK_BYTES, quantize_kquant

    cfg = json.loads((folder / "config.json").read_text())
    sd = load_file(str(folder / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_eos_token_id(2)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, t in sd.items():
        a = t.float().numpy()
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            base, kind = ".".join(rest[:-1]), rest[-1]
            if base == "self_attn.q_proj":
                a = _llamacpp_permute(a, cfg["num_attention_heads"])
            elif base == "self_attn.k_proj":
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
