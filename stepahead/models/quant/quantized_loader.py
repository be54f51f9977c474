"""`--quantization`: which linear layers of a built model run on packed weights, and where the codes come from.

- "gguf": the GGUF file's Q4_0 / Q4_1 / Q5_0 / Q8_0 and Q4_K / Q5_K / Q6_K tensors stay quantized, each
  in its own format (their codes come from models/quant/gguf_quantized.py); other tensors stay dense.
  k-quants need stepahead's kernels: where those are not built they load dense too (logged once).
- "int4" / "int8": any checkpoint's projections quantized at load (int4: groups of 32 with scale and
  offset; int8: one scale per row).
- "none": every weight dense in the model's dtype (the reference path).
- "auto": "gguf" on CPU when the checkpoint is a GGUF file holding such tensors, else "none".

A MoE block's experts (models/moe.py) become PackedExperts, two packed linears per expert: in "gguf"
mode when the file holds every expert matrix of the layer as Q4_0/Q4_1/Q8_0 (other types stay dense,
with a log line), in "int4"/"int8" mode always. Every row of a packed expert runs its packed kernel.

The swap runs after the dense model is built and loaded, and finds the projections by name (modules
called qkv_proj, o_proj, gate_up_proj or down_proj holding a 2-D `.weight` [out, in]), so it works for
any linear class that keeps that weight. A fused projection is quantized only when every part of it
is. In "gguf" mode the output head is packed too when the file holds it quantized, as a
RescoredHead (models/quant/packed_head.py: the packed kernel ranks the vocabulary, the best candidates get
exact fp32 logits); "int4"/"int8" keep the head dense, as vLLM's weight-only methods do. The
embedding stays dense in the model's dtype (a lookup reads a few rows).

A packed projection on torch's kernels (no AVX2 build, or groups other than GGUF's 32) also keeps
its dense weight (the same values) for prompt tokens, which are prefilled many at a time where fp32
GEMM is several times faster than torch's weight-only kernels (models/quant/prompt_rows.py), unless this
machine's BLAS computes a row differently depending on the rest of the call (checked at load per
weight shape). stepahead's own kernels run prompt tokens too: they are faster than fp32 GEMM at
every row count measured (docs/BENCHMARKS.md, section 14.4), and the dense copy would cost 4 bytes
per weight.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from stepahead.config import QUANTIZATION_CHOICES
from stepahead.kernels import cpu_packed
from stepahead.models.moe import DenseExperts, MoeBlock, PackedExperts
from stepahead.models.quant.gguf_quantized import KEPT_TYPES, PackedCodes
from stepahead.models.quant.kquant_weights import KQuantWeight, cat_kquant_rows
from stepahead.models.quant.packed_head import RescoredHead
from stepahead.models.quant.prompt_rows import rows_are_invariant
from stepahead.models.quant.quant_weights import (
    GGUF_QUANT_TYPES,
    GroupQuantWeight,
    as_symmetric_int8,
    cat_rows,
    quantize_int4,
    quantize_int8_rows,
)
from stepahead.models.quant.quantized_linear import PackedParts, quantized_linear

logger = logging.getLogger(__name__)

LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
INT4_ROWS_MULTIPLE = 16  # torch's int4 CPU packing needs out_features % 16 == 0


def resolve_quantization(requested: str, device: str, load_format: str, gguf_quantized: bool) -> str:
    """The mode a model loads with; a ValueError naming the allowed values when it cannot apply."""
    if requested not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {requested!r}")
    if requested == "auto":
        return "gguf" if device == "cpu" and load_format == "gguf" and gguf_quantized else "none"
    if requested != "none" and device != "cpu":
        raise ValueError(f"quantization {requested!r} runs on CPU only (its kernels are torch's CPU ones); "
                         "use 'none' or 'auto' on CUDA")
    if requested == "gguf" and not (load_format == "gguf" and gguf_quantized):
        raise ValueError(f"quantization 'gguf' needs a GGUF file with {'/'.join(KEPT_TYPES)} tensors; "
                         "use 'int4', 'int8' or 'none' for this model")
    return requested


# -- the swap ------------------------------------------------------------------------------------

def _format(w: PackedCodes) -> tuple:
    """What parts must share to be fused into one packed weight."""
    return (w.type_name,) if isinstance(w, KQuantWeight) else (w.bits, w.group_size, w.mins is None)


def _source_weight(module_name: str, sources: dict[str, PackedCodes]) -> PackedCodes | list[PackedCodes] | None:
    """The codes of a module from per-checkpoint-tensor codes: one weight (its parts fused), the parts
    apart where they are packed differently (PackedParts), or None to keep it dense."""
    prefix, _, leaf = module_name.rpartition(".")
    hf_prefix = prefix if prefix.startswith("model.") else "model." + prefix
    if f"{hf_prefix}.{leaf}.weight" in sources:  # fused in the checkpoint already (Phi-3)
        return sources[f"{hf_prefix}.{leaf}.weight"]
    found = [sources.get(f"{hf_prefix}.{part}.weight") for part in FUSED_PARTS.get(leaf, (leaf,))]
    if any(w is None for w in found):
        return None
    parts = [w for w in found if w is not None]
    if len({_format(w) for w in parts}) > 1:
        symmetric = [as_symmetric_int8(w) if isinstance(w, GroupQuantWeight) else None for w in parts]
        if any(w is None for w in symmetric):
            return _runs_fused(parts)  # each run of parts in its own format, side by side
        parts = [w for w in symmetric if w is not None]  # Q4_0 / Q5_0 beside Q8_0: all int8 codes, exactly
    return _fused(parts)


def _runs_fused(parts: list[PackedCodes]) -> list[PackedCodes]:
    """Neighbouring parts of one format fused (q and k of Q4_K beside v of Q6_K: two parts, not three)."""
    runs: list[list[PackedCodes]] = []
    for w in parts:
        if runs and _format(runs[-1][0]) == _format(w):
            runs[-1].append(w)
        else:
            runs.append([w])
    return [run[0] if len(run) == 1 else _fused(run) for run in runs]


def _fused(parts: list[PackedCodes]) -> PackedCodes:
    """Parts of one format as one weight."""
    if isinstance(parts[0], KQuantWeight):
        return cat_kquant_rows([w for w in parts if isinstance(w, KQuantWeight)])
    return cat_rows([w for w in parts if isinstance(w, GroupQuantWeight)])


def _packed_module(name: str, weight: PackedCodes | list[PackedCodes], bias: torch.Tensor | None) -> nn.Module | None:
    """The packed module for one weight, or for parts packed differently (PackedParts: stepahead's
    kernel only, and whole tiles of columns; else None, the module stays dense, logged)."""
    if not isinstance(weight, list):
        return quantized_linear(_packable(weight), bias)
    if not cpu_packed.available() or any(w.shape[0] % cpu_packed.TILE for w in weight[:-1]):
        logger.info("%s: parts quantized differently and no packed kernel runs them side by side here, kept dense",
                    name)
        return None
    parts = [quantized_linear(_packable(w)) for w in weight]
    if any(getattr(p, "kernel", None) != "stepahead" for p in parts):
        logger.info("%s: parts quantized differently, one without stepahead's kernel, kept dense", name)
        return None
    return PackedParts(parts, bias)


def _packable(w: PackedCodes) -> PackedCodes:
    if isinstance(w, GroupQuantWeight) and w.bits == 4 and w.shape[0] % INT4_ROWS_MULTIPLE:
        return quantize_int8_rows(w.dequantize())
    return w


def _without_kernel(sources: dict[str, PackedCodes]) -> dict[str, PackedCodes]:
    """sources less the k-quants where stepahead's kernels are not built (torch has none for them): those
    stay dense, named in one log line."""
    if cpu_packed.available():
        return sources
    dense = sorted(name for name, w in sources.items() if isinstance(w, KQuantWeight))
    if dense:
        logger.info("stepahead's CPU kernels are not built here: %d k-quant tensors load dense (%s, ...)",
                    len(dense), dense[0])
    return {name: w for name, w in sources.items() if not isinstance(w, KQuantWeight)}


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str, sources: dict[str, PackedCodes] | None = None) -> int:
    """Swap the model's projections (and in "gguf" mode a quantized head) for packed ones; returns how
    many modules were swapped.

    mode "gguf" takes the codes from sources (HF tensor name -> codes); "int4"/"int8" quantize the
    loaded dense weights."""
    if mode not in ("gguf", "int4", "int8"):
        raise ValueError(f"quantize_model mode must be gguf, int4 or int8, got {mode!r}")
    targets = [(name, m) for name, m in model.named_modules()
               if name.rpartition(".")[2] in LINEAR_NAMES and getattr(m, "weight", None) is not None
               and m.weight.dim() == 2]
    sources = _without_kernel(sources or {})
    swapped = 0
    dense_invariant: dict[tuple[int, int], bool] = {}  # BLAS picks its code path by shape, not values
    for name, module in targets:
        weight: PackedCodes | list[PackedCodes] | None
        if mode == "gguf":
            weight = _source_weight(name, sources)
        else:
            weight = _quantized(module.weight, mode)
        if weight is None:
            continue
        shape = (sum(w.shape[0] for w in weight), weight[0].shape[1]) if isinstance(weight, list) else weight.shape
        if shape != tuple(module.weight.shape):
            raise ValueError(f"{name}: quantized weight has shape {shape}, the model's is {tuple(module.weight.shape)}")
        packed = _packed_module(name, weight, getattr(module, "bias", None))
        if packed is None:
            continue
        if packed.kernel == "torch":  # prompt rows then run dense (see above)
            # A GGUF model was loaded from the file's own dequantization: the same values.
            assert not isinstance(weight, list)  # PackedParts run stepahead's kernel
            dense = module.weight.detach() if mode == "gguf" else weight.dequantize().to(module.weight.dtype)
            shape = tuple(dense.shape)
            if shape not in dense_invariant:
                dense_invariant[shape] = rows_are_invariant(dense)
            if dense_invariant[shape]:
                packed.keep_dense(dense)
                model.dense_prompt_rows = True
        _set_module(model, name, packed)
        swapped += 1
    variant = [shape for shape, ok in dense_invariant.items() if not ok]
    if variant:
        logger.info("dense GEMM rows depend on their batch for weight shapes %s on this machine: prompt "
                    "tokens run the packed kernels there", variant)
    swapped += _pack_experts(model, mode, sources or {})
    if mode == "gguf" and _pack_head(model, sources):
        swapped += 1
    return swapped


def _quantized(weight: torch.Tensor, mode: str) -> GroupQuantWeight:
    return quantize_int4(weight) if mode == "int4" else quantize_int8_rows(weight)


def _pack_experts(model: nn.Module, mode: str, sources: dict[str, PackedCodes]) -> int:
    """Swap each MoE block's dense experts for PackedExperts; returns how many blocks were swapped."""
    swapped = 0
    for name, block in model.named_modules():
        if not isinstance(block, MoeBlock) or not isinstance(block.experts, DenseExperts):
            continue
        dense = block.experts
        gate_up, down = [], []
        for e in range(dense.num_experts):
            if mode == "gguf":
                pair = (_source_weight(f"{name}.experts.{e}.gate_up_proj", sources),
                        _source_weight(f"{name}.experts.{e}.down_proj", sources))
            else:
                pair = (_quantized(dense.gate_up_proj[e], mode), _quantized(dense.down_proj[e], mode))
            if not all(isinstance(w, GroupQuantWeight) for w in pair):  # absent, or parts in two formats
                break
            for weight, like in zip(pair, (dense.gate_up_proj[e], dense.down_proj[e]), strict=True):
                if weight.shape != tuple(like.shape):
                    raise ValueError(f"{name}: expert {e}'s quantized weight has shape {weight.shape}, "
                                     f"the model's is {tuple(like.shape)}")
            gate_up.append(quantized_linear(_packable(pair[0])))
            down.append(quantized_linear(_packable(pair[1])))
        if len(down) < dense.num_experts:
            logger.info("%s: experts kept dense (the file does not hold every expert matrix as %s)", name,
                        "/".join(GGUF_QUANT_TYPES))
            continue
        block.experts = PackedExperts(gate_up, down)
        swapped += 1
    return swapped


def _pack_head(model: nn.Module, sources: dict[str, PackedCodes]) -> bool:
    """Give the model a RescoredHead when the file holds its head quantized: its `output` tensor, or
    `token_embd` when the embedding is tied (llama.cpp reads it so)."""
    head = getattr(model, "lm_head", None)
    if head is None:
        return False
    weight = sources.get("model.embed_tokens.weight" if model.args.tie_word_embeddings else "lm_head.weight")
    dense = head.shard_weight().detach()
    if weight is None or weight.shape != tuple(dense.shape):
        return False
    model.lm_head = RescoredHead(quantized_linear(_packable(weight)), dense)
    return True
