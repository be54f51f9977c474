"""A GGUF file's quantized tensors as codes, for `--quantization gguf`: Q4_0 / Q4_1 / Q5_0 / Q8_0
(models/quant/quant_weights.py) and the k-quants Q4_K / Q5_K / Q6_K (models/quant/kquant_weights.py),
and the model-cache file that keeps them (QUANT_FILE, written beside the converted dense weights).
Other quantized types (Q5_1, Q2_K, IQ*, ...) have no kernel here and load dense, logged once."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from stepahead.models.loading import gguf_loader
from stepahead.models.quant.kquant_weights import KQUANT_TYPES, KQuantWeight, decode_kquant_blocks
from stepahead.models.quant.quant_weights import GGUF_QUANT_TYPES, GroupQuantWeight, decode_gguf_blocks

logger = logging.getLogger(__name__)

KEPT_TYPES = (*GGUF_QUANT_TYPES, *KQUANT_TYPES)  # the GGUF types `gguf` mode keeps packed
DENSE_TYPES = ("F32", "F16", "BF16", "F64")  # not quantized: dense in any mode
PackedCodes = GroupQuantWeight | KQuantWeight

QUANT_FILE = "quantized_weights.st"  # in a model-cache entry; not *.safetensors, which dense loads read


def iter_gguf_quantized(path: str, cfg: dict) -> Iterator[tuple[str, PackedCodes]]:
    """(HF name, codes) for every tensor of a GGUF file in a KEPT_TYPES type, Q/K rows un-permuted (a
    stacked experts tensor of Q4_0/Q4_1/Q8_0 gives one entry per expert). A
    quantized tensor of another type (no kernel here) is left to the dense load, named in one log line."""
    reader = gguf_loader.open_reader(path)
    left_dense: dict[str, int] = {}
    for t in reader.tensors:
        stacked = gguf_loader.expert_tensor(t.name)
        if stacked is not None and t.tensor_type.name in GGUF_QUANT_TYPES:  # one matrix of codes per expert
            experts, out_features, in_features = (int(d) for d in reversed(t.shape))
            for e in range(experts):
                yield gguf_loader.expert_hf_name(*stacked, e), decode_gguf_blocks(t.data[e], t.tensor_type.name,
                                                                                    (out_features, in_features))
            continue
        name = gguf_loader.hf_name(t.name, cfg.get("gguf_arch"))
        type_name = t.tensor_type.name
        if name is None:
            continue
        if type_name not in KEPT_TYPES:
            if type_name not in DENSE_TYPES:
                left_dense[type_name] = left_dense.get(type_name, 0) + 1
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        if len(shape) != 2:
            continue
        weight: PackedCodes = (decode_kquant_blocks(t.data, type_name, shape) if type_name in KQUANT_TYPES
                               else decode_gguf_blocks(t.data, type_name, shape))
        heads = gguf_loader.permuted_heads(name, cfg)
        if heads is not None:  # rows are independent codes: un-permute them as whole rows
            rows = np.arange(shape[0]).reshape(shape[0], 1)
            weight = weight.take_rows(gguf_loader.unpermute_qk(rows, heads).reshape(-1))
        yield name, weight
    if left_dense:
        logger.info("%s: no packed kernel for %s; those tensors load dense (float32)", path,
                    ", ".join(f"{count} {kind}" for kind, count in sorted(left_dense.items())))


def gguf_has_quantized(path: str) -> bool:
    return any(t.tensor_type.name in KEPT_TYPES for t in gguf_loader.open_reader(path).tensors)


def save_quantized(weights: Iterator[tuple[str, PackedCodes]], path: Path) -> None:
    """Codes as a safetensors file: NAME.q (uint8 4- or 5-bit codes, or int8 ones), NAME.scales,
    NAME.mins; a k-quant as NAME.kq (its codes), NAME.d, NAME.sc, NAME.dmin, NAME.m. The metadata names
    each tensor's bits ("bits5") or k-quant type ("Q6_K")."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for name, w in weights:
        if isinstance(w, KQuantWeight):
            kinds[name] = w.type_name
            parts = {"kq": w.q, "d": w.d, "sc": w.scales, "dmin": w.dmin, "m": w.mins}
        else:
            kinds[name] = f"bits{w.bits}"
            parts = {"q": w.q, "scales": w.scales, "mins": w.mins}
        tensors |= {f"{name}.{key}": t.contiguous() for key, t in parts.items() if t is not None}
    save_file(tensors, str(path), metadata=kinds)


def load_quantized(path: Path) -> dict[str, PackedCodes]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        kinds = f.metadata() or {}
    out: dict[str, PackedCodes] = {}
    for key, q in tensors.items():
        if key.endswith(".q"):
            name = key[:-2]
            scales = tensors[f"{name}.scales"]
            out[name] = GroupQuantWeight(q, scales, tensors.get(f"{name}.mins"), q.shape[1] // scales.shape[1],
                                         int(kinds[name].removeprefix("bits")))
        elif key.endswith(".kq"):
            name = key[:-3]
            out[name] = KQuantWeight(kinds[name], q, tensors[f"{name}.d"], tensors[f"{name}.sc"],
                                     tensors.get(f"{name}.dmin"), tensors.get(f"{name}.m"))
    return out
