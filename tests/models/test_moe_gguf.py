"""Mixtures of experts from GGUF files written here in llama.cpp's layout (experts stacked in
ffn_{gate,up,down}_exps tensors, the router in ffn_gate_inp; Qwen3-MoE as `qwen3moe`, Mixtral as `llama`
with an expert count), and quantized experts: the file's Q4_0/Q4_1/Q8_0 codes or --quantization int4/int8."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from stepahead import LLM, SamplingParams
from stepahead.bench.full_forward import sequence_logits
from stepahead.models.loading.loader import load_model, load_model_config
from stepahead.models.moe import DenseExperts, MoeBlock, PackedExperts
from tests.models.gguf_writer import write_gguf
from tests.tiny_models import MOE_ARCHS, hf_greedy

EXPERT_QUANT = {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q8_0", "attn_q": "Q8_0"}
PROMPT = list(range(40, 90))


def _blocks(model) -> list[MoeBlock]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoeBlock)]


def _prompts() -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in (15, 31, 47, 14, 30)]


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in _prompts()], params,
                                                        use_tqdm=False)]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_gguf_twin_loads_the_safetensors_weights_and_generates_transformers_tokens(tiny_model_factory, tmp_path,
                                                                                 arch):
    folder = tiny_model_factory(arch)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(folder, path)
    g_cfg = load_model_config(str(path), "cpu", use_cache=False)
    s_cfg = load_model_config(str(folder), "cpu")
    assert g_cfg.architecture == s_cfg.architecture
    if arch == "qwen3_moe":
        assert g_cfg.hf_config["mlp_only_layers"] == [1]  # the layer without a router
    g, s = load_model(g_cfg, "cpu"), load_model(s_cfg, "cpu")
    assert len(_blocks(g)) == len(_blocks(s)) > 0
    for (n, a), (_, b) in zip(g.named_parameters(), s.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    with LLM(str(path), tokenizer=str(folder), executor="uni", max_model_len=96) as llm:
        assert _greedy(llm) == hf_greedy(folder, _prompts(), 8)


@pytest.fixture(scope="module")
def quantized_moe_gguf(tiny_model_factory, tmp_path_factory):
    path = tmp_path_factory.mktemp("qmoe") / "tiny-moe-q.gguf"
    write_gguf(tiny_model_factory("qwen3_moe"), path, EXPERT_QUANT)
    return path


def test_packed_experts_follow_the_dequantized_ones(quantized_moe_gguf):
    packed = load_model(load_model_config(str(quantized_moe_gguf), "cpu", quantization="auto", use_cache=False),
                        "cpu")
    dense = load_model(load_model_config(str(quantized_moe_gguf), "cpu", quantization="none", use_cache=False),
                       "cpu")
    for p_block, d_block in zip(_blocks(packed), _blocks(dense), strict=True):
        p, d = p_block.experts, d_block.experts
        assert isinstance(p, PackedExperts) and isinstance(d, DenseExperts)
        assert [type(m).__name__ for m in (p.gate_up[0], p.down[0])] == ["Int4Linear", "Int8Linear"]
        for e in range(d.num_experts):  # the file's values, held as codes
            torch.testing.assert_close(p.gate_up[e].dequantized_weight(), d.gate_up_proj[e], rtol=0, atol=2e-3)
            torch.testing.assert_close(p.down[e].dequantized_weight(), d.down_proj[e], rtol=0, atol=2e-3)
    a, b = sequence_logits(packed, PROMPT), sequence_logits(dense, PROMPT)
    assert float((a - b).abs().max()) < 0.05 * float(b.abs().max())


def test_packed_experts_give_the_same_tokens_chunked_and_preempted(tiny_model_factory, quantized_moe_gguf):
    kwargs = dict(tokenizer=str(tiny_model_factory("qwen3_moe")), executor="uni", max_model_len=96,
                  quantization="auto")
    with LLM(str(quantized_moe_gguf), **kwargs) as llm:
        plain = _greedy(llm)
    with LLM(str(quantized_moe_gguf), max_num_batched_tokens=8, num_kv_blocks=8, **kwargs) as llm:
        assert _greedy(llm) == plain
        assert llm.stats().preemptions > 0


def test_experts_without_a_packed_kernel_stay_dense(tiny_model_factory, tmp_path, caplog):
    """A layer whose expert matrices are not all codes (here the up projections are float16) keeps
    its experts dense, and says so."""
    path = tmp_path / "f16-up.gguf"
    write_gguf(tiny_model_factory("mixtral"), path, {**EXPERT_QUANT, "ffn_up_exps": "F16"})
    with caplog.at_level(logging.INFO, logger="stepahead.models.quant.quantized_loader"):
        model = load_model(load_model_config(str(path), "cpu", quantization="auto", use_cache=False), "cpu")
    assert all(isinstance(b.experts, DenseExperts) for b in _blocks(model))
    assert "experts kept dense" in caplog.text


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_int4_and_int8_quantize_the_experts_at_load(tiny_model_factory, arch):
    folder = str(tiny_model_factory(arch))
    ref = sequence_logits(load_model(load_model_config(folder, "cpu"), "cpu"), PROMPT)
    # The mean error, relative: quantization moves some router logits past each other and those tokens
    # switch experts, a large error on few rows (wrong weights or routing miss by the logits' whole size).
    for mode, tol in (("int8", 0.03), ("int4", 0.25)):
        model = load_model(load_model_config(folder, "cpu", quantization=mode), "cpu")
        experts = _blocks(model)[0].experts
        assert isinstance(experts, PackedExperts)
        assert type(experts.down[0]).__name__ == ("Int4Linear" if mode == "int4" else "Int8Linear")
        assert float((sequence_logits(model, PROMPT) - ref).abs().mean()) < tol * float(ref.abs().mean())
