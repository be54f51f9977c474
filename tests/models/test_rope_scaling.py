"""Rope scaling yarn and dynamic, for every family: a Llama and a Qwen2 tiny checkpoint with each type
generate transformers' float32 greedy tokens; the scaled frequencies and attention factors equal
transformers' own (yarn with its optional fields, longrope with partial rotary); the context each
type allows is vLLM's."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from stepahead import LLM, SamplingParams
from stepahead.bench.full_forward import sequence_logits
from stepahead.models.llama_args import LlamaArgs
from stepahead.models.loading.loader import load_model, load_model_config
from stepahead.models.rope import max_context, rope_inv_freq
from tests.models.gguf_writer import write_gguf
from tests.tiny_models import hf_greedy, hf_logits, tiny_config

MAX_TOKENS = 8
SCALINGS = {
    # the tiny model's 512 positions are yarn's stretch of an original 128
    "yarn": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                  "rope_theta": 10000.0}),
    "dynamic": dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in (4, 30, 150)]


@pytest.mark.parametrize("kind", list(SCALINGS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_transformers(tiny_model_factory, arch, kind):
    """dynamic: positions stay within max_position_embeddings, where vLLM's table and transformers'
    per-length recomputation agree (both are the unscaled rope there)."""
    folder = tiny_model_factory(arch, **SCALINGS[kind])
    with LLM(str(folder), executor="uni", max_model_len=256) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(folder, _prompts(), MAX_TOKENS)


@pytest.mark.parametrize("kind", list(SCALINGS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_transformers(tiny_model_factory, arch, kind):
    """Logits over a 150-token prompt: the tiny model's greedy ids barely see rope (its logits are
    small), these do (yarn without its attention factor moves them by about 4e-3, fp32 rounding by 2e-7)."""
    folder = tiny_model_factory(arch, **SCALINGS[kind])
    prompt = _prompts()[-1]
    model = load_model(load_model_config(str(folder), "cpu", max_model_len=256), "cpu")
    torch.testing.assert_close(sequence_logits(model, prompt), hf_logits(folder, prompt), rtol=0, atol=1e-5)


def test_context_each_type_allows(tiny_model_factory):
    """As vLLM derives it: yarn's original context times its factor, dynamic's max_position_embeddings
    times its factor."""
    yarn = load_model_config(str(tiny_model_factory("llama", **SCALINGS["yarn"])), "cpu")
    dynamic = load_model_config(str(tiny_model_factory("qwen2", **SCALINGS["dynamic"])), "cpu")
    assert (yarn.max_model_len, dynamic.max_model_len) == (512, 1024)


def test_yarn_gguf_matches_safetensors_twin(tiny_model_factory, tmp_path):
    """A llama GGUF file with llama.cpp's yarn keys (type, factor, original context)."""
    folder = tiny_model_factory("llama", **SCALINGS["yarn"])
    path = tmp_path / "yarn.gguf"
    write_gguf(folder, path)
    g_cfg, s_cfg = load_model_config(str(path), "cpu"), load_model_config(str(folder), "cpu")
    g_args = LlamaArgs.from_hf_config("LlamaForCausalLM", g_cfg.hf_config)
    s_args = LlamaArgs.from_hf_config("LlamaForCausalLM", s_cfg.hf_config)
    assert g_args.rope_scaling == {key: s_args.rope_scaling[key] for key in g_args.rope_scaling}
    assert g_cfg.max_model_len == s_cfg.max_model_len == 512
    prompts = _prompts()
    with LLM(str(path), executor="uni", max_model_len=256, tokenizer=str(folder)) as llm:  # the file has none
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(folder, prompts, MAX_TOKENS)


def _hf_rope(config) -> tuple[torch.Tensor, float]:
    config.standardize_rope_params()
    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, "cpu")


@pytest.mark.parametrize("extra", [
    {},
    {"mscale": 0.707, "mscale_all_dim": 1.0},  # DeepSeek's pair
    {"attention_factor": 1.25, "beta_fast": 16, "beta_slow": 2},
    {"truncate": False},  # gpt-oss keeps the ramp's bounds fractional
])
def test_yarn_frequencies_equal_transformers(extra):
    rope = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "rope_theta": 50000.0,
            **extra}
    config = tiny_config("llama", rope_parameters=dict(rope), head_dim=32)
    inv, attention = rope_inv_freq(LlamaArgs.from_hf_config("LlamaForCausalLM", config.to_dict()), 512)
    hf_inv, hf_attention = _hf_rope(config)
    assert torch.allclose(inv.float(), hf_inv, rtol=1e-6, atol=0)
    assert attention == pytest.approx(hf_attention, rel=1e-12)


@pytest.mark.parametrize("positions", [128, 512])
def test_longrope_frequencies_equal_transformers(positions):
    """Phi-4-mini's shape: 3/4 of each head rotates. transformers' long set is the one it switches to
    past the original context."""
    rng = random.Random(0)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [rng.uniform(1, 2) for _ in range(6)], "long_factor": [rng.uniform(2, 8) for _ in range(6)]}
    config = transformers.Phi3Config(**{**tiny_config("llama").to_dict(), "rope_parameters": rope,
                                        "original_max_position_embeddings": 128})
    args = LlamaArgs.from_hf_config("Phi3ForCausalLM", config.to_dict())
    inv, attention = rope_inv_freq(args, positions)
    config.standardize_rope_params()
    hf_inv, hf_attention = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=positions)
    assert inv.shape == (6,) and torch.allclose(inv.float(), hf_inv, rtol=1e-6, atol=0)
    assert attention == pytest.approx(hf_attention, rel=1e-12)
    assert max_context(args) == 512
