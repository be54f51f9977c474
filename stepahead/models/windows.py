"""Each layer's attention window, read from a checkpoint's config the way transformers reads it.

A window of w means a token attends to itself and the w - 1 tokens before it (transformers'
`kv_idx > q_idx - sliding_window`). None: the layer attends to the whole context.
"""

from __future__ import annotations

# How a family lays its windowed layers out when the config has no `layer_types` list
# (layer index, config) -> whether that layer is windowed.
_PATTERNS = {
    "MistralForCausalLM": lambda i, cfg: True,
    "Phi3ForCausalLM": lambda i, cfg: True,
    "MixtralForCausalLM": lambda i, cfg: True,
    "Qwen2ForCausalLM": lambda i, cfg: i >= cfg.get("max_window_layers", 0),
    "Qwen3ForCausalLM": lambda i, cfg: i >= cfg.get("max_window_layers", 0),
    "Gemma2ForCausalLM": lambda i, cfg: (i + 1) % 2 != 0,
    "Gemma3ForCausalLM": lambda i, cfg: (i + 1) % int(cfg.get("sliding_window_pattern", 6)) != 0,
}
# Qwen2 and Qwen3 configs carry a sliding_window that applies only when use_sliding_window is set.
_OPT_IN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")


def layer_windows(architecture: str, cfg: dict, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window (None: full attention); () when no layer has one. ValueError for a window
    that is not a positive integer or a layer_types list of the wrong length or kind."""
    window = cfg.get("sliding_window")
    pattern = _PATTERNS.get(architecture)
    if not window or pattern is None or (architecture in _OPT_IN and not cfg.get("use_sliding_window")):
        return ()
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    types = cfg.get("layer_types")
    # Mistral's model applies its window to every layer whatever layer_types says (as transformers does).
    if types is not None and architecture != "MistralForCausalLM":
        if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types must list 'sliding_attention' or 'full_attention' for each of the "
                             f"{num_layers} layers, got {types!r}")
        windows = tuple(window if kind == "sliding_attention" else None for kind in types)
    else:
        windows = tuple(window if pattern(i, cfg) else None for i in range(num_layers))
    return windows if any(w is not None for w in windows) else ()
