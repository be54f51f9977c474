"""Each layer's attention window from a checkpoint's config, as transformers lays the layers out."""

from __future__ import annotations

import pytest
import transformers

from stepahead.models.windows import layer_windows

LAYERS = 8


def _hf_windows(config) -> tuple[int | None, ...]:
    """The windows transformers' own config gives each layer (its layer_types)."""
    return tuple(config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types)


@pytest.mark.parametrize("config_class,arch,extra", [
    (transformers.Qwen2Config, "Qwen2ForCausalLM", dict(use_sliding_window=True, max_window_layers=3)),
    (transformers.Qwen3Config, "Qwen3ForCausalLM", dict(use_sliding_window=True, max_window_layers=5)),
    (transformers.Gemma2Config, "Gemma2ForCausalLM", {}),
    (transformers.Gemma3TextConfig, "Gemma3ForCausalLM", {}),
    (transformers.Gemma3TextConfig, "Gemma3ForCausalLM", dict(sliding_window_pattern=3)),
])
def test_windows_follow_transformers_layer_types(config_class, arch, extra):
    config = config_class(num_hidden_layers=LAYERS, sliding_window=24, **extra)
    saved = config.to_dict()
    expected = _hf_windows(config)
    assert any(w is None for w in expected) and any(w == 24 for w in expected)
    assert layer_windows(arch, saved, LAYERS) == expected
    # a config without layer_types (as older checkpoints have) gets the family's pattern
    saved.pop("layer_types")
    assert layer_windows(arch, saved, LAYERS) == expected


def test_mistral_windows_every_layer_and_qwen_only_when_asked():
    assert layer_windows("MistralForCausalLM", {"sliding_window": 16}, 3) == (16, 16, 16)
    assert layer_windows("MistralForCausalLM", {"sliding_window": None}, 3) == ()
    qwen = transformers.Qwen2Config(num_hidden_layers=4, sliding_window=16, use_sliding_window=False).to_dict()
    qwen["sliding_window"] = 16  # a checkpoint may keep the number while the switch is off
    assert layer_windows("Qwen2ForCausalLM", qwen, 4) == ()
    assert layer_windows("LlamaForCausalLM", {"sliding_window": 16}, 4) == ()


def test_a_bad_window_or_layer_list_is_refused_by_name():
    with pytest.raises(ValueError, match="sliding_window"):
        layer_windows("MistralForCausalLM", {"sliding_window": -3}, 2)
    with pytest.raises(ValueError, match="layer_types"):
        layer_windows("Gemma2ForCausalLM", {"sliding_window": 8, "layer_types": ["sliding_attention"]}, 2)
