"""Which model implementation serves which checkpoint architecture.

A family is one implementation (its own module under models/) and the HF architecture names it
serves; the loader, the parallel-size check and the support error all go through family_of. A new
family adds its module and one entry to FAMILIES."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from stepahead.distributed.state import ParallelState


class CausalLM(Protocol):
    """What the loader and the model runner use of a family's model (an nn.Module)."""

    args: Any  # the family's arguments: hidden_size, num_layers, ...
    shard: Any  # this rank's part of a layer: num_kv_heads, ...
    layers: nn.ModuleList
    cpu_kernels: bool  # whether decode attention runs stepahead's CPU kernel
    dense_prompt_rows: bool

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def load_weights(self, weights: Any) -> None: ...
    def use_cpu_kernels(self) -> None: ...
    def use_triton_fused(self) -> None: ...
    def use_onednn(self) -> None: ...
    def init_rope(self, max_positions: int, dtype: torch.dtype, device: Any) -> None: ...
    def can_capture_graphs(self) -> bool: ...


@dataclass(frozen=True)
class ModelFamily:
    name: str
    architectures: tuple[str, ...]
    # (architecture, HF config dict) -> the family's arguments; KeyError for a missing field,
    # ValueError for a value the family cannot run (e.g. an unsupported rope scaling type).
    args_from_config: Callable[[Any, dict], Any]
    # (arguments, parallel state) -> the model at one rank, a CausalLM
    model_class: Callable[[Any, ParallelState], nn.Module]
    # (arguments, tensor-parallel size, pipeline-parallel size): ValueError naming the numbers
    check_parallel_sizes: Callable[[Any, int, int], None]


def _families() -> tuple[ModelFamily, ...]:
    from stepahead.models import gemma, llama, llama_args, moe_families, phi3

    return (
        ModelFamily("Llama", llama.SUPPORTED_ARCHITECTURES, llama_args.LlamaArgs.from_hf_config,
                    llama.LlamaForCausalLM, llama_args.check_parallel_sizes),
        ModelFamily("Phi3", phi3.SUPPORTED_ARCHITECTURES, phi3.phi3_args, phi3.Phi3ForCausalLM,
                    llama_args.check_parallel_sizes),
        ModelFamily("Gemma", gemma.SUPPORTED_ARCHITECTURES, gemma.GemmaArgs.from_hf_config,
                    gemma.GemmaForCausalLM, llama_args.check_parallel_sizes),
        ModelFamily("Qwen3-MoE", moe_families.QWEN3_MOE_ARCHITECTURES, moe_families.qwen3_moe_args,
                    llama.LlamaForCausalLM, llama_args.check_parallel_sizes),
        ModelFamily("Mixtral", moe_families.MIXTRAL_ARCHITECTURES, moe_families.mixtral_args,
                    llama.LlamaForCausalLM, llama_args.check_parallel_sizes),
    )


# Architectures refused with a reason of their own (a text family serves their checkpoints' text part).
REFUSED = {
    "Gemma3ForConditionalGeneration": "the multimodal Gemma 3 (text and images) is not supported; "
                                      "its text-only checkpoints (Gemma3ForCausalLM) are",
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(arch for family in _families() for arch in family.architectures)


def family_of(architecture: str | None) -> ModelFamily:
    """The family serving this architecture; a ValueError naming it and the supported list otherwise."""
    for family in _families():
        if architecture in family.architectures:
            return family
    if architecture in REFUSED:
        raise ValueError(f"model architecture {architecture!r}: {REFUSED[architecture]}")
    raise ValueError(f"model architecture {architecture!r} is not supported (supported: "
                     f"{', '.join(supported_architectures())})")


def model_args(architecture: str | None, hf_config: dict) -> Any:
    """The family's arguments for a checkpoint's config (they hold `architecture`); every problem a
    ValueError."""
    family = family_of(architecture)
    try:
        return family.args_from_config(architecture, hf_config)
    except KeyError as e:
        raise ValueError(f"model config lacks the field {e.args[0]!r}") from e
