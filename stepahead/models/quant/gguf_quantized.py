"""A GGUF file's Q4_0 / Q4_1 / Q8_0 tensors as codes (models/quant/quant_weights.py), for `--quantization gguf`,
and the model-cache file that keeps them (QUANT_FILE, written beside the converted dense weights)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from stepahead.models.loading import gguf_loader
from stepahead.models.quant.quant_weights import GGUF_QUANT_TYPES, GroupQuantWeight, decode_gguf_blocks

QUANT_FILE = "quantized_weights.st"  # in a model-cache entry; not *.safetensors, which dense loads read


def iter_gguf_quantized(path: str, cfg: dict) -> Iterator[tuple[str, GroupQuantWeight]]:
    """(HF name, codes) for every Q4_0/Q4_1/Q8_0 tensor of a GGUF file, Q/K rows un-permuted; a
    stacked experts tensor gives one entry per expert."""
    reader = gguf_loader.open_reader(path)
    for t in reader.tensors:
        stacked = gguf_loader.expert_tensor(t.name)
        if stacked is not None and t.tensor_type.name in GGUF_QUANT_TYPES:  # one matrix of codes per expert
            experts, out_features, in_features = (int(d) for d in reversed(t.shape))
            for e in range(experts):
                yield gguf_loader.expert_hf_name(*stacked, e), decode_gguf_blocks(t.data[e], t.tensor_type.name,
                                                                                    (out_features, in_features))
            continue
        name = gguf_loader.hf_name(t.name, cfg.get("gguf_arch"))
        if name is None or t.tensor_type.name not in GGUF_QUANT_TYPES:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        if len(shape) != 2:
            continue
        weight = decode_gguf_blocks(t.data, t.tensor_type.name, shape)
        heads = gguf_loader.permuted_heads(name, cfg)
        if heads is not None:  # rows are independent codes: un-permute them as whole rows
            rows = np.arange(shape[0]).reshape(shape[0], 1)
            weight = weight.take_rows(gguf_loader.unpermute_qk(rows, heads).reshape(-1))
        yield name, weight


def gguf_has_quantized(path: str) -> bool:
    return any(t.tensor_type.name in GGUF_QUANT_TYPES for t in gguf_loader.open_reader(path).tensors)


def save_quantized(weights: Iterator[tuple[str, GroupQuantWeight]], path: Path) -> None:
    """Codes as a safetensors file: NAME.q (uint8 4-bit or int8 codes), NAME.scales, NAME.mins."""
    from safetensors.torch import save_file

    tensors = {}
    for name, w in weights:
        tensors[f"{name}.q"] = w.q.contiguous()
        tensors[f"{name}.scales"] = w.scales.contiguous()
        if w.mins is not None:
            tensors[f"{name}.mins"] = w.mins.contiguous()
    save_file(tensors, str(path))


def load_quantized(path: Path) -> dict[str, GroupQuantWeight]:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    out = {}
    for key, q in tensors.items():
        if key.endswith(".q"):
            name = key[:-2]
            scales = tensors[f"{name}.scales"]
            out[name] = GroupQuantWeight(q, scales, tensors.get(f"{name}.mins"), q.shape[1] // scales.shape[1],
                                         4 if q.dtype == torch.uint8 else 8)
    return out
