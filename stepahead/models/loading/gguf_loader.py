"""GGUF checkpoints: config from metadata, tensors dequantized and renamed to the HF layout.

llama.cpp's converter permutes the rows of Q and K for Llama-style models (its RoPE pairs adjacent
dimensions, HF checkpoints pair the two halves); we undo that so one model implementation serves both.
Phi-3 files keep the checkpoint's fused attn_qkv and gate/up (as ffn_up) unpermuted, and LongRoPE's
factors as the rope_factors_long/short tensors, which become the config's rope_scaling.

Mixtures of experts (llama.cpp's `qwen3moe`, and `llama` with an expert count for Mixtral) store each
layer's experts as 3-D tensors (ffn_gate_exps, ffn_up_exps, ffn_down_exps: [E, rows, cols]); they are
read as one HF-named matrix per expert (model.layers.N.mlp.experts.E.gate_proj.weight, ...).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from stepahead.models.loading.weights import WeightHandle

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                      "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w (what the norm multiplies by); HF
# checkpoints, and the model here, hold w.
NORM_PLUS_ONE_ARCHITECTURES = {"gemma2", "gemma3"}
MIXTRAL = "MixtralForCausalLM"  # llama.cpp writes Mixtral as `llama` with an expert count
# Architectures whose converter permutes Q/K rows.
PERMUTED_ARCHITECTURES = {"llama", "mistral"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_qkv": "self_attn.qkv_proj",
    "ffn_gate_inp": "mlp.gate",
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the one before the MLP.
_GEMMA_LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
# Where an architecture's tensor of that kind holds something else: Phi-3's ffn_up is gate_up_proj.
_ARCH_LAYER_NAMES = {"phi3": {"ffn_up": "mlp.gate_up_proj"}, "gemma2": _GEMMA_LAYER_NAMES,
                     "gemma3": _GEMMA_LAYER_NAMES}
# A layer's experts stacked in one tensor -> the HF name of one expert's matrix
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def open_reader(path: str):
    """The file's parsed reader; config and weights share it (parsing the metadata takes seconds)."""
    stat = Path(path).stat()
    return _open_version(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)  # keyed by size and mtime too: a file rewritten in place is parsed again
def _open_version(path: str, _size: int, _mtime_ns: int):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on truncated or foreign files
        raise ValueError(f"model {path!r} is not a readable GGUF file: {e}") from e


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf_config(path: str) -> tuple[str, dict]:
    """(architecture, config.json-style dict) from a GGUF file's metadata."""
    reader = open_reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        vocab = next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight")
    cfg = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "gguf_arch": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
    }
    experts = _field(reader, f"{arch}.expert_count")
    if experts:
        cfg.update(_moe_config(reader, arch, int(experts), names, cfg))
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    elif scaling == "yarn":
        cfg["rope_scaling"] = _yarn_scaling(reader, arch, cfg["max_position_embeddings"])
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    if arch == "phi3":
        cfg.update(_phi3_config(reader, cfg))
    if arch in NORM_PLUS_ONE_ARCHITECTURES:
        cfg.update(_gemma_config(reader, arch, cfg))
    return cfg["architectures"][0], cfg


def _moe_config(reader, arch: str, experts: int, names: set[str], cfg: dict) -> dict:
    """The config.json fields of a mixture of experts. llama.cpp's qwen3moe renormalises the top-k
    weights unless the file says otherwise; a layer without a router (ffn_gate_inp) is dense."""
    if arch not in ("llama", "qwen3moe"):
        raise ValueError(f"GGUF architecture {arch!r} with experts is not supported")
    moe: dict = {"num_experts": experts, "num_experts_per_tok": int(_field(reader, f"{arch}.expert_used_count"))}
    if arch == "llama":
        return {**moe, "architectures": [MIXTRAL]}
    expert_ffn = int(_field(reader, f"{arch}.expert_feed_forward_length"))
    layers = range(cfg["num_hidden_layers"])
    return {**moe, "moe_intermediate_size": expert_ffn,
            "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length", expert_ffn)),
            "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm", True)),
            "mlp_only_layers": [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in names]}


def expert_tensor(name: str) -> tuple[str, str] | None:
    """(layer index, HF projection) of a layer's stacked experts (blk.N.ffn_up_exps.weight), else None."""
    parts = name.split(".")
    if parts[0] != "blk" or parts[2] not in _EXPERT_NAMES:
        return None
    return parts[1], _EXPERT_NAMES[parts[2]]


def expert_hf_name(layer: str, projection: str, expert: int) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"


def _yarn_scaling(reader, arch: str, context: int) -> dict:
    """rope_scaling of a yarn file: its factor, original context and ramp bounds. DeepSeek's log
    multiplier (the HF mscale pair) is refused rather than guessed."""
    if _field(reader, f"{arch}.rope.scaling.yarn_log_multiplier"):
        raise ValueError("GGUF yarn rope scaling with yarn_log_multiplier is not supported")
    scaling = {"rope_type": "yarn", "factor": float(_field(reader, f"{arch}.rope.scaling.factor")),
               "original_max_position_embeddings": int(_field(reader, f"{arch}.rope.scaling.original_context_length",
                                                              context))}
    for name in ("beta_fast", "beta_slow"):
        value = _field(reader, f"{arch}.rope.scaling.yarn_{name}")
        if value is not None:
            scaling[name] = float(value)
    return scaling


def _phi3_config(reader, cfg: dict) -> dict:
    """What a Phi-3 file adds: the rotary share of each head, the sliding window (0: none, as Phi-4
    writes it), the original context, and LongRoPE from the factor tensors."""
    extra: dict = {}
    rope_dims = _field(reader, "phi3.rope.dimension_count")
    if rope_dims is not None:
        extra["partial_rotary_factor"] = int(rope_dims) / cfg["head_dim"]
    window = int(_field(reader, "phi3.attention.sliding_window", 0) or 0)
    extra["sliding_window"] = window or None
    original = _field(reader, "phi3.rope.scaling.original_context_length")
    if original is not None:
        extra["original_max_position_embeddings"] = int(original)
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if factors:
        extra["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": [float(x) for x in np.asarray(factors["rope_factors_long.weight"].data).reshape(-1)],
            "short_factor": [float(x) for x in np.asarray(factors["rope_factors_short.weight"].data).reshape(-1)],
        }
        attn_factor = _field(reader, "phi3.rope.scaling.attn_factor")
        if attn_factor is not None:
            extra["rope_scaling"]["attention_factor"] = float(attn_factor)
    return extra


# llama.cpp's defaults where its Gemma converters write no key: every other layer windowed (Gemma 2),
# five in six (Gemma 3); Gemma 3's global rope base and its local one.
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_LARGEST_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models, whose query scale differs


def _gemma_config(reader, arch: str, cfg: dict) -> dict:
    """Gemma's config fields from the file: the window and which layers have it, the logit caps, the
    query scale and (Gemma 3) the rope bases, as llama.cpp reads them."""
    layers = cfg["num_hidden_layers"]
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", _GEMMA_PATTERN[arch])
    if isinstance(pattern, list):  # one flag a layer: windowed or not
        windowed = [bool(flag) for flag in pattern]
    else:  # llama.cpp's period: the last layer of each period is global
        windowed = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    extra: dict = {
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
        "attn_logit_softcapping": _field(reader, f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": _field(reader, f"{arch}.final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
    }
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window is not None:
        extra["sliding_window"] = int(window)
    scale = _field(reader, f"{arch}.attention.scale")
    if scale is not None:
        extra["query_pre_attn_scalar"] = float(scale) ** -2
    elif layers == _GEMMA_LARGEST_LAYERS[arch]:
        extra["query_pre_attn_scalar"] = cfg["hidden_size"] / cfg["num_attention_heads"]
    else:
        extra["query_pre_attn_scalar"] = cfg["head_dim"]
    if arch == "gemma3":
        extra["rope_theta"] = float(_field(reader, f"{arch}.rope.freq_base", 1_000_000.0))
        extra["rope_local_base_freq"] = float(_field(reader, f"{arch}.rope.freq_base_swa", 10_000.0))
    return extra


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permute(): rows (head, pair, half) back to (head, half, pair)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permuted_heads(name: str, cfg: dict) -> int | None:
    """The head count whose rows llama.cpp's converter permuted in this (HF-named) tensor, or None."""
    if cfg.get("gguf_arch") not in PERMUTED_ARCHITECTURES:
        return None
    if name.endswith("self_attn.q_proj.weight"):
        return cfg["num_attention_heads"]
    if name.endswith("self_attn.k_proj.weight"):
        return cfg["num_key_value_heads"]
    return None


def hf_name(name: str, gguf_arch: str | None = None) -> str | None:
    parts = name.split(".")
    if parts[0] == "blk":
        base = _ARCH_LAYER_NAMES.get(gguf_arch or "", {}).get(parts[2]) or _LAYER_NAMES.get(parts[2])
        return None if base is None else f"model.layers.{parts[1]}.{base}.{parts[3]}"
    base = _GLOBAL_NAMES.get(parts[0])
    return None if base is None else f"{base}.{parts[1]}"


def iter_gguf_weights(path: str, cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of the file, dequantized and un-permuted."""
    for name, handle in iter_gguf_weight_handles(path, cfg):
        yield name, handle.load()


def iter_gguf_weight_handles(path: str, cfg: dict) -> Iterator[tuple[str, WeightHandle]]:
    """(HF name, lazy handle) for every tensor of the file: a tensor is dequantized from the memmap only
    when the model reads it, so a pipeline stage never reads the layers of other stages."""
    reader = open_reader(path)
    arch = cfg.get("gguf_arch")
    for t in reader.tensors:
        stacked = expert_tensor(t.name)
        if stacked is not None:
            shape = tuple(int(d) for d in reversed(t.shape))
            for e in range(shape[0]):
                read = functools.partial(_read_gguf_slice, t, shape[1:], None, 0.0, expert=e)
                yield expert_hf_name(*stacked, e), WeightHandle(shape[1:], read)
            continue
        name = hf_name(t.name, arch)
        if name is None:
            if t.name.startswith(("rope_freqs", "rope_factors_")):  # rope's own tables (read into the config)
                continue
            raise ValueError(f"GGUF tensor {t.name!r} has no known mapping")
        shape = tuple(int(d) for d in reversed(t.shape))
        offset = 1.0 if arch in NORM_PLUS_ONE_ARCHITECTURES and name.endswith("norm.weight") else 0.0
        read = functools.partial(_read_gguf_slice, t, shape, permuted_heads(name, cfg), offset)
        yield name, WeightHandle(shape, read)


def _read_gguf_slice(t, shape: tuple[int, ...], heads: int | None, offset: float, dim: int, start: int,
                     length: int, expert: int | None = None) -> torch.Tensor:
    """The tensor's slice as HF holds it: un-permuted, less `offset` (Gemma's norms); or a slice of one
    expert's matrix (its first index) in a stacked experts tensor."""
    from gguf.quants import dequantize

    data = t.data if expert is None else t.data[expert]
    w = np.asarray(dequantize(data, t.tensor_type), dtype=np.float32).reshape(shape)
    if offset:
        w = w - np.float32(offset)
    if heads is not None:
        w = unpermute_qk(w, heads)
    if w.ndim:
        w = w[tuple(slice(None) if d != dim else slice(start, start + length) for d in range(w.ndim))]
    return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # copy: the file is mmapped read-only


def convert_to_folder(path: str, folder: Path, dtype: torch.dtype) -> None:
    """Write the GGUF file as a model folder: config.json, the tokenizer's files (when the file holds a
    tokenizer), model.safetensors in dtype."""
    import json

    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    _arch, cfg = read_gguf_config(path)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    if open_reader(path).fields.get("tokenizer.ggml.model") is not None:
        tokenizer_folder, name = gguf_tokenizer_location(path)
        AutoTokenizer.from_pretrained(tokenizer_folder, gguf_file=name).save_pretrained(str(folder))
    num_tensors = len(open_reader(path).tensors)
    weights = {name: w.to(dtype) for name, w in tqdm(iter_gguf_weights(path, cfg), total=num_tensors,
                                                      desc=f"Converting {Path(path).name} (first load only)")}
    save_file(weights, str(folder / "model.safetensors"))


def gguf_tokenizer_location(path: str) -> tuple[str, str]:
    p = Path(path)
    return str(p.parent), p.name
