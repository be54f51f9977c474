"""Quantized weights: GGUF block decoding, packed linears against their dequantized weights, and whole
models (tiny GGUF files written here, the built-in SmolLM2) against the dense float32 reference path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stepahead.bench.full_forward import sequence_logits
from stepahead.kernels import cpu_build, cpu_packed
from stepahead.models.loading.loader import load_model, load_model_config
from stepahead.models.quant import prompt_rows, quantized_loader
from stepahead.models.quant.prompt_rows import ALL_PROMPT_ROWS, PromptRows, dense_rows, rows_are_invariant
from stepahead.models.quant.quant_weights import decode_gguf_blocks, quantize_int4, quantize_int8_rows
from stepahead.models.quant.quantized_linear import Int4Linear, Int8Linear
from tests.models.gguf_writer import write_gguf

# bf16 activations against float32 ones: relative error of the output, over a K=64..576 dot product.
LINEAR_RTOL = 2e-2


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_gguf_blocks_decode_exactly(type_name):
    import gguf
    import gguf.quants

    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    dense = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    raw = gguf.quants.quantize(dense, qtype)
    weight = decode_gguf_blocks(raw, type_name, (48, 96))
    assert weight.bits == int(type_name[1]) and weight.group_size == 32
    assert torch.equal(weight.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, qtype)))


def _rel_err(y, ref):
    return float((y - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("out_features,in_features", [(64, 64), (1536, 576)])
def test_int4_linear_equals_its_dequantized_weight(out_features, in_features):
    torch.manual_seed(0)
    codes = quantize_int4(torch.randn(out_features, in_features))
    layer = Int4Linear(codes, bias=torch.randn(out_features))
    # The kernel's weight is the codes' weight up to bf16 scales and zeros.
    assert _rel_err(layer.dequantized_weight(), codes.dequantize()) < 1e-2
    x = torch.randn(5, in_features)
    ref = x @ codes.dequantize().t() + layer.bias
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (5, out_features)
    assert _rel_err(y, ref) < LINEAR_RTOL


def test_int8_linear_equals_its_dequantized_weight():
    torch.manual_seed(0)
    codes = quantize_int8_rows(torch.randn(96, 128))
    layer = Int8Linear(codes)
    x = torch.randn(3, 128)
    assert _rel_err(layer(x), x @ codes.dequantize().t()) < LINEAR_RTOL
    # Q8_0's group scales (float16 in the file) run on stepahead's kernel, or are requantized to one
    # scale per row for torch's: either way close to the block values.
    from stepahead.models.quant.quant_weights import GroupQuantWeight
    q = torch.randint(-127, 128, (96, 128), dtype=torch.int8)
    grouped = GroupQuantWeight(q, (torch.rand(96, 4) * 0.01).half().float(), None, 32, 8)
    assert _rel_err(Int8Linear(grouped).dequantized_weight(), grouped.dequantize()) < 1e-2


QUANT_TYPES = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q8_0",
               "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q4_1", "output": "Q8_0"}


@pytest.fixture(scope="module")
def quantized_gguf(tiny_model_factory, tmp_path_factory):
    path = tmp_path_factory.mktemp("qgguf") / "tiny-q.gguf"
    write_gguf(tiny_model_factory("llama"), path, QUANT_TYPES)
    return path


@pytest.mark.parametrize("use_cache", [True, False])
def test_quantized_gguf_model_follows_the_dequantized_one(quantized_gguf, use_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("STEPAHEAD_CACHE", str(tmp_path / "cache"))
    packed_cfg = load_model_config(str(quantized_gguf), "cpu", quantization="auto", use_cache=use_cache)
    dense_cfg = load_model_config(str(quantized_gguf), "cpu", quantization="none", use_cache=use_cache)
    assert (packed_cfg.quantization, dense_cfg.quantization) == ("gguf", "none")
    packed, dense = load_model(packed_cfg, "cpu"), load_model(dense_cfg, "cpu")
    kinds = {type(m).__name__ for m in packed.modules()}
    assert "Int4Linear" in kinds and type(packed.lm_head).__name__ == "RescoredHead"  # the file's Q8_0 output
    layer = packed.layers[0]
    assert _rel_err(layer.self_attn.qkv_proj.dequantized_weight(), dense.layers[0].self_attn.qkv_proj.weight) < 1e-2
    assert _rel_err(layer.mlp.down_proj.dequantized_weight(), dense.layers[0].mlp.down_proj.weight) < 1e-2
    assert type(layer.self_attn.o_proj).__name__ == "Int8Linear"  # Q8_0
    # float32 runs rope, norms and decode attention on stepahead's kernels, packed or dense; only
    # packed projections run DecodeStack.
    for model in (packed, dense):
        assert model.cpu_kernels == cpu_build.available() and model.layers[0].self_attn.kernel == model.cpu_kernels
    assert dense.decode_stack is None
    prompt = list(range(40, 104))
    a, b = sequence_logits(packed, prompt), sequence_logits(dense, prompt)
    assert float((a - b).abs().max()) < 0.05 * float(b.abs().max())


def test_int4_and_int8_quantize_a_safetensors_model(tiny_llama):
    dense = load_model(load_model_config(str(tiny_llama), "cpu", quantization="none"), "cpu")
    prompt = list(range(3, 60))
    ref = sequence_logits(dense, prompt)
    for mode, tol in (("int8", 0.02), ("int4", 0.15)):
        cfg = load_model_config(str(tiny_llama), "cpu", quantization=mode)
        model = load_model(cfg, "cpu")
        gate_up = model.layers[1].mlp.gate_up_proj
        assert type(gate_up).__name__ == ("Int4Linear" if mode == "int4" else "Int8Linear")
        # Only torch's kernels (int8's per-row codes) may keep a dense copy for prompt rows (where this
        # machine's BLAS passes the row-invariance check); stepahead's int4 kernel runs every row.
        assert (gate_up.kernel == "torch") == (mode == "int8" or not cpu_packed.available())
        assert model.dense_prompt_rows == (gate_up.dense is not None)
        if gate_up.kernel == "stepahead":
            assert gate_up.dense is None and not model.dense_prompt_rows
        assert float((sequence_logits(model, prompt) - ref).abs().max()) < tol * float(ref.abs().max())
        assert type(model.lm_head).__name__ == "ParallelLMHead"  # int4/int8 keep the head dense, as vLLM


def test_quantization_errors_name_the_allowed_values(tiny_llama, quantized_gguf):
    with pytest.raises(ValueError, match="auto, none, gguf, int8, int4"):
        quantized_loader.resolve_quantization("fp8", "cpu", "gguf", True)
    with pytest.raises(ValueError, match="needs a GGUF file"):
        load_model_config(str(tiny_llama), "cpu", quantization="gguf")
    with pytest.raises(ValueError, match="CPU only"):
        quantized_loader.resolve_quantization("int4", "cuda", "safetensors", False)
    assert load_model_config(str(tiny_llama), "cpu").quantization == "none"  # auto: nothing to keep
    assert quantized_loader.resolve_quantization("auto", "cuda", "gguf", True) == "none"


def test_more_than_one_rank_loads_dense_weights(quantized_gguf):
    """Packed codes are whole matrices, not split by rank: auto falls back to dense, explicit is an error."""
    from stepahead.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(quantized_gguf), tensor_parallel_size=2, quantization="auto").create_engine_config()
    assert config.model_config.quantization == "none"
    one_rank = EngineArgs(model=str(quantized_gguf), quantization="auto").create_engine_config()
    assert one_rank.model_config.quantization == "gguf"
    assert EngineArgs(model=str(quantized_gguf)).create_engine_config().model_config.quantization == "gguf"
    with pytest.raises(ValueError, match=r"quantization 'int4' runs on one rank only \(tensor_parallel_size=2"):
        EngineArgs(model=str(quantized_gguf), tensor_parallel_size=2, quantization="int4").create_engine_config()


def test_builtin_model_packed_agrees_with_fp32():
    from stepahead.models.loading.loader import load_tokenizer

    packed_cfg = load_model_config(None, "cpu", quantization="auto")
    dense_cfg = load_model_config(None, "cpu", dtype="float32", quantization="none")
    assert packed_cfg.quantization == "gguf"
    packed, dense = load_model(packed_cfg, "cpu"), load_model(dense_cfg, "cpu")
    assert type(packed.lm_head).__name__ == "RescoredHead"  # on the tied Q8_0 token_embd, as llama.cpp
    tok = load_tokenizer(packed_cfg)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    a, b = sequence_logits(packed, ids), sequence_logits(dense, ids)
    assert float((a - b).abs().mean()) < 0.25  # logits span about 30; measured 0.12-0.14
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.9
    from stepahead.bench.full_forward import greedy_tokens
    assert "Paris" in tok.decode(greedy_tokens(packed, ids, 8))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_is_computed_the_same_in_any_batch(bits):
    """Batch invariance: every step runs the packed kernel, and the kernel computes each row on its own,
    so a row's output is bitwise the same alone as among many rows (tokens do not depend on batching)."""
    torch.manual_seed(0)
    w = torch.randn(96, 128)
    layer = Int4Linear(quantize_int4(w)) if bits == 4 else Int8Linear(quantize_int8_rows(w))
    x = torch.randn(300, 128)
    alone = torch.cat([layer(x[i:i + 1]) for i in (0, 7, 299)])
    for rows in (8, 17, 64, 300):
        batch = layer(x[:rows])
        assert torch.equal(batch[0], alone[0]) and torch.equal(batch[7], alone[1])
    assert torch.equal(layer(x)[299], alone[2])


@pytest.mark.parametrize("vocab", [512, 4096])  # 4 and 32 chunks of 128: topk over all, and best chunks first
def test_rescored_head_gives_the_dense_heads_best_logits_row_by_row(vocab):
    from stepahead.models.quant.packed_head import RESCORED_LOGITS, RescoredHead

    torch.manual_seed(0)
    codes = quantize_int8_rows(torch.randn(vocab, 64))
    dense = codes.dequantize()
    head = RescoredHead(Int8Linear(codes), dense)
    hidden = torch.randn(40, 64) * 4
    logits, ref = head(hidden), hidden @ dense.t()
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    top = ref.topk(RESCORED_LOGITS // 2, dim=-1)
    # The best candidates carry the dense head's logits (up to fp32 summation order) ...
    assert torch.allclose(logits.gather(-1, top.indices), top.values, rtol=1e-5, atol=0)
    # ... the rest the packed kernel's bf16-rounded ones, which are visibly coarser.
    assert float((logits - ref).abs().max()) > 1e-3
    alone = torch.cat([head(hidden[i:i + 1]) for i in range(hidden.shape[0])])
    assert torch.equal(alone, head(hidden))  # a row's logits do not depend on its batch


@pytest.mark.parametrize("vocab", [128 * 48, 1000])
def test_best_indices_are_each_rows_k_largest(vocab):
    from stepahead.models.quant.packed_head import CHUNK, best_indices

    torch.manual_seed(0)
    logits = torch.randn(6, vocab)
    logits[0, 2 * CHUNK:2 * CHUNK + 16] += 10  # all of a row's best in one chunk
    logits[1, ::CHUNK] += 10  # one in each of its first chunks
    logits[2, -3:] += 10  # at the end of the vocabulary
    for k in (1, 16):
        expected = logits.topk(k, dim=-1).indices.sort(-1).values
        assert torch.equal(best_indices(logits, k).sort(-1).values, expected)


def test_prompt_rows_run_the_dense_weight_and_generated_rows_the_packed_kernel():
    torch.manual_seed(0)
    codes = quantize_int4(torch.randn(64, 128))
    layer = Int4Linear(codes, bias=torch.randn(64))
    layer.keep_dense(codes.dequantize())
    x = torch.randn(10, 128)
    dense = dense_rows(x, codes.dequantize(), layer.bias)
    # The dense path rounds like the packed kernel: bf16 activations in, bf16 out, then the bias.
    rounded = torch.nn.functional.linear(x.bfloat16().float(), codes.dequantize()).bfloat16().float() + layer.bias
    assert _rel_err(dense, rounded) < 1e-2
    packed = layer(x)  # no prompt rows: every row on the packed kernel
    assert not torch.equal(packed, dense) and _rel_err(packed, dense) < LINEAR_RTOL
    assert torch.equal(layer(x, ALL_PROMPT_ROWS), dense)
    prompt = torch.tensor([2, 3, 4, 7])
    others = torch.tensor([0, 1, 5, 6, 8, 9])
    mixed = layer(x, PromptRows(prompt, others))
    assert torch.equal(mixed[prompt], dense[prompt])  # padded dense calls are row-invariant (checked below)
    assert torch.equal(mixed[others], packed[others])  # the packed kernel is row-invariant


@pytest.mark.skipif(not cpu_build.machine_can_build(), reason="needs an AVX2 CPU and a C++ compiler")
def test_dense_rows_round_in_place_as_torchs_conversions_would(monkeypatch):
    """The kernels' in-place rounding (round_bf16.cpp) gives what the two .to() copies give without them."""
    torch.manual_seed(0)
    x, weight, bias = torch.randn(21, 64) * 5, torch.randn(48, 64), torch.randn(48)
    in_place = dense_rows(x, weight, bias)
    monkeypatch.setattr(prompt_rows.cpu_build, "available", lambda: False)
    assert torch.equal(dense_rows(x, weight, bias), in_place)


@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536), (64, 128)])
def test_dense_rows_compute_a_row_the_same_in_any_padded_call(shape):
    """Where the load-time check passes on this machine's BLAS, what it promises holds: a prompt row's
    dense output does not depend on how many rows share its call or where it sits. (Where it fails,
    prompt rows of that shape stay packed.)"""
    torch.manual_seed(0)
    weight, bias = torch.randn(*shape) * 0.05, torch.randn(shape[0])
    if not rows_are_invariant(weight):
        pytest.skip(f"this machine's BLAS computes rows of a {shape} weight differently by call size")
    x = torch.randn(300, shape[1])
    everything = dense_rows(x, weight, bias)
    for start, n in ((0, 1), (5, 3), (17, 11), (40, 64), (100, 200)):
        assert torch.equal(dense_rows(x[start:start + n], weight, bias), everything[start:start + n])
