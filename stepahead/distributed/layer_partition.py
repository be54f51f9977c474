"""Which decoder layers each pipeline stage holds: vLLM's split (get_pp_indices) and its override.

By default the stages get num_layers // P layers each, and the remainder one more each, given to
the stages before the last from the second-to-last backwards (the last stage also holds the final
norm and the LM head). STEPAHEAD_PP_LAYER_PARTITION (vLLM's VLLM_PP_LAYER_PARTITION) sets the
counts instead: comma-separated, one per stage, summing to the layer count.
"""

from __future__ import annotations

import os

PARTITION_ENV = "STEPAHEAD_PP_LAYER_PARTITION"


def partition_from_env() -> tuple[int, ...] | None:
    """The override's layer counts, or None when the variable is unset or empty."""
    text = os.environ.get(PARTITION_ENV, "").strip()
    return parse_layer_partition(text) if text else None


def parse_layer_partition(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(count) for count in text.split(","))
    except ValueError:
        raise ValueError(f"{PARTITION_ENV}={text!r}: must be comma-separated layer counts, one per pipeline "
                         "stage (e.g. '2,1')") from None


def layer_partition(num_layers: int, pp_size: int, override: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Each stage's layer count, first stage first; a ValueError naming the numbers when they cannot be."""
    if override is not None:
        if len(override) != pp_size:
            raise ValueError(f"{PARTITION_ENV} gives {len(override)} layer counts {list(override)}, "
                             f"but pipeline_parallel_size={pp_size}")
        if sum(override) != num_layers:
            raise ValueError(f"{PARTITION_ENV} layer counts {list(override)} sum to {sum(override)}, "
                             f"but the model has num_hidden_layers={num_layers}")
        if min(override) < 1:
            raise ValueError(f"{PARTITION_ENV} layer counts {list(override)}: every stage needs at least one layer")
        return override
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds num_hidden_layers={num_layers}: "
                         "every stage needs at least one layer")
    per_stage, remainder = divmod(num_layers, pp_size)
    counts = [per_stage] * pp_size
    for stage in range(pp_size - 1 - remainder, pp_size - 1):
        counts[stage] += 1
    return tuple(counts)


def stage_layer_range(num_layers: int, pp_rank: int, pp_size: int,
                      override: tuple[int, ...] | None = None) -> range:
    """The global indices of the layers stage pp_rank holds."""
    counts = layer_partition(num_layers, pp_size, override)
    start = sum(counts[:pp_rank])
    return range(start, start + counts[pp_rank])
