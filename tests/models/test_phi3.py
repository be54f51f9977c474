"""Phi-3 / Phi-4 (Phi3ForCausalLM): greedy token ids equal transformers' float32 on tiny random
checkpoints with Phi-4-mini's partial rope (3/4 of each head) and LongRoPE in both of its regimes, from
safetensors and from a GGUF file laid out as llama.cpp's converter writes phi3."""

from __future__ import annotations

import random

import pytest
import torch

from stepahead.bench.full_forward import sequence_logits
from stepahead.models.llama_args import LlamaArgs
from stepahead.models.loading.loader import load_model, load_model_config
from stepahead.models.rope import rope_cos_sin
from tests.models.gguf_writer import write_gguf
from tests.tiny_models import hf_greedy, hf_logits, llm_greedy, phi3_longrope

MAX_TOKENS = 8
ORIGINAL = 128  # the tiny LongRoPE checkpoint's original context; it is stretched to 4x
ROTARY_HALF = 6  # head_dim 16, partial_rotary_factor 0.75: 12 rotary features, 6 frequencies


@pytest.fixture(scope="module")
def tiny_phi3(tiny_model_factory):
    return tiny_model_factory("phi3")


@pytest.fixture(scope="module")
def tiny_phi3_longrope(tiny_model_factory):
    return tiny_model_factory("phi3", **phi3_longrope(ORIGINAL))


def _prompts(lengths, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in lengths]


def _generate(folder, prompts, **engine) -> list[list[int]]:
    return llm_greedy(folder, prompts, MAX_TOKENS, **engine)


def test_partial_rotary_greedy_matches_transformers(tiny_phi3):
    prompts = _prompts((3, 17, 40))
    assert _generate(tiny_phi3, prompts, max_model_len=256) == hf_greedy(tiny_phi3, prompts, MAX_TOKENS)


def test_longrope_short_factors_within_the_original_context(tiny_phi3_longrope):
    """max_model_len within the original context: the short factors throughout, as transformers uses
    them while every sequence stays within it."""
    prompts = _prompts((5, 33, 70))
    got = _generate(tiny_phi3_longrope, prompts, max_model_len=ORIGINAL)
    assert got == hf_greedy(tiny_phi3_longrope, prompts, MAX_TOKENS)


def test_longrope_long_factors_past_the_original_context(tiny_phi3_longrope):
    """max_model_len past the original context: the long factors at every position; transformers
    agrees when every prompt already exceeds the original context."""
    prompts = _prompts((ORIGINAL + 3, ORIGINAL + 40))
    got = _generate(tiny_phi3_longrope, prompts, max_model_len=4 * ORIGINAL)
    assert got == hf_greedy(tiny_phi3_longrope, prompts, MAX_TOKENS)


@pytest.mark.parametrize("max_model_len,prompt_len", [(ORIGINAL, 70), (4 * ORIGINAL, ORIGINAL + 42)],
                         ids=["short-factors", "long-factors"])
def test_longrope_logits_match_transformers(tiny_phi3_longrope, max_model_len, prompt_len):
    """The tiny model's logits are small (random weights), so greedy ids barely see rope: its logits
    over a whole prompt do (the other factor set moves them by about 1e-2, fp32 rounding by 1e-7)."""
    (prompt,) = _prompts((prompt_len,), seed=3)
    model = load_model(load_model_config(str(tiny_phi3_longrope), "cpu", max_model_len=max_model_len), "cpu")
    torch.testing.assert_close(sequence_logits(model, prompt), hf_logits(tiny_phi3_longrope, prompt),
                               rtol=0, atol=1e-5)


def test_longrope_picks_its_factors_once_by_max_model_len(tiny_phi3_longrope):
    """Where stepahead (as vLLM) and transformers part: with max_model_len past the original context a
    short prompt is rotated by the long factors too (transformers would use the short ones until the
    sequence crosses the original context)."""
    args = load_model_config(str(tiny_phi3_longrope), "cpu").hf_config
    margs = LlamaArgs.from_hf_config("Phi3ForCausalLM", args)
    short = rope_cos_sin(margs, ORIGINAL, torch.float64, "cpu")
    long = rope_cos_sin(margs, 4 * ORIGINAL, torch.float64, "cpu")
    assert short.shape == (ORIGINAL, 2, 2 * ROTARY_HALF)
    assert not torch.allclose(short[1:ORIGINAL], long[1:ORIGINAL])
    # the attention factor scales both: sqrt(1 + ln 4 / ln 128) at position 0, where cos is 1
    expected = (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(float(ORIGINAL)))).sqrt().item()
    assert short[0, 0, 0].item() == pytest.approx(expected) and long[0, 0, 0].item() == pytest.approx(expected)


def test_gguf_matches_safetensors_twin(tiny_phi3_longrope, tmp_path):
    """A phi3 GGUF file (fused attn_qkv and ffn_up, LongRoPE factor tensors, rope dimension count)
    loads the safetensors twin's weights and config, and generates transformers' tokens."""
    path = tmp_path / "phi3.gguf"
    write_gguf(tiny_phi3_longrope, path)
    g_cfg = load_model_config(str(path), "cpu", max_model_len=ORIGINAL)
    s_cfg = load_model_config(str(tiny_phi3_longrope), "cpu", max_model_len=ORIGINAL)
    assert (g_cfg.architecture, g_cfg.load_format) == ("Phi3ForCausalLM", "gguf")
    g_args = LlamaArgs.from_hf_config("Phi3ForCausalLM", g_cfg.hf_config)
    s_args = LlamaArgs.from_hf_config("Phi3ForCausalLM", s_cfg.hf_config)
    assert g_args.partial_rotary_factor == s_args.partial_rotary_factor == 0.75
    for field in ("short_factor", "long_factor", "original_max_position_embeddings"):
        assert g_args.rope_scaling[field] == pytest.approx(s_args.rope_scaling[field])
    g, s = load_model(g_cfg, "cpu"), load_model(s_cfg, "cpu")
    for (n, a), (_, b) in zip(g.named_parameters(), s.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    # the file holds the factors (and the attention factor) as float32, the config as decimals
    assert torch.allclose(g.rope_cache, s.rope_cache, rtol=0, atol=1e-5)
    prompts = _prompts((9, 50), seed=2)
    got = _generate(path, prompts, max_model_len=ORIGINAL, tokenizer=str(tiny_phi3_longrope))  # the file has none
    assert got == hf_greedy(tiny_phi3_longrope, prompts, MAX_TOKENS)


def test_bad_longrope_factors_are_a_value_error(tiny_model_factory, tmp_path):
    import json
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(tiny_model_factory("phi3", **phi3_longrope(ORIGINAL)), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"]["long_factor"] = cfg["rope_parameters"]["long_factor"][:-1]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="long_factor must hold 6 values"):
        load_model_config(str(folder), "cpu")


def test_quantized_gguf_packs_the_fused_projections(tiny_phi3_longrope, tmp_path):
    """A phi3 file's quantized attn_qkv and ffn_up (gate and up) stay packed as one projection each
    (--quantization auto on CPU) and the model follows the same file run dense; int8 quantizes the
    safetensors twin's fused projections."""
    path = tmp_path / "phi3-q.gguf"
    write_gguf(tiny_phi3_longrope, path, {"attn_qkv": "Q4_1", "ffn_up": "Q4_0", "attn_output": "Q8_0",
                                          "ffn_down": "Q4_1"})
    packed = load_model(load_model_config(str(path), "cpu", max_model_len=ORIGINAL, quantization="auto"), "cpu")
    dense = load_model(load_model_config(str(path), "cpu", max_model_len=ORIGINAL, quantization="none"), "cpu")
    layer = packed.layers[0]
    assert type(layer.self_attn.qkv_proj).__name__ == type(layer.mlp.gate_up_proj).__name__ == "Int4Linear"
    prompt = list(range(40, 104))
    ref = sequence_logits(dense, prompt)
    assert float((sequence_logits(packed, prompt) - ref).abs().max()) < 0.05 * float(ref.abs().max())
    int8 = load_model(load_model_config(str(tiny_phi3_longrope), "cpu", max_model_len=ORIGINAL,
                                        quantization="int8"), "cpu")
    assert type(int8.layers[1].self_attn.qkv_proj).__name__ == "Int8Linear"
    twin = load_model(load_model_config(str(tiny_phi3_longrope), "cpu", max_model_len=ORIGINAL), "cpu")
    ref = sequence_logits(twin, prompt)
    assert float((sequence_logits(int8, prompt) - ref).abs().max()) < 0.02 * float(ref.abs().max())


def test_sliding_window_runs_the_whole_context(tiny_model_factory):
    """A Phi-3 window (Phi-3-mini-4k has 2047 of 4096) shorter than prompt + output: the whole context,
    windowed attention, transformers' greedy ids."""
    folder = tiny_model_factory("phi3", sliding_window=12)
    assert load_model_config(str(folder), "cpu").max_model_len == 512
    prompts = _prompts((5, 20, 40))
    assert _generate(folder, prompts, max_model_len=256, block_size=4) == hf_greedy(folder, prompts, MAX_TOKENS)
