"""Whole tiny models from GGUF files holding k-quants (written here: tests/models/kquant_blocks.py),
each tensor packed in its own format, against the same file loaded dense in float32; the model cache
keeping the k-quant codes; dense fallback where a projection's parts differ or a tensor is F16; a decode
step over parts packed differently the same on every instruction set the GEMM can choose."""

from __future__ import annotations

import pytest
import torch

from stepahead.bench.full_forward import greedy_tokens, sequence_logits
from stepahead.kernels import cpu_build
from stepahead.models.loading.loader import load_model, load_model_config
from tests.models.gguf_writer import write_gguf

pytestmark = pytest.mark.skipif(not cpu_build.machine_can_build(), reason="needs an AVX2 CPU and a C++ compiler")

# k-quants need rows of whole 256-weight blocks: hidden 256, intermediate 512.
SHAPE = {"hidden_size": 256, "intermediate_size": 512}
PACKED_MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q8_0",
              "ffn_gate": "Q5_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K", "output": "Q6_K"}
# as llama-quantize makes Q4_K_M of a model whose rows are not whole 256-weight blocks: Q5_0 for Q4_K,
# Q8_0 for Q6_K (some layers' attn_v), k-quants where the rows allow
FALLBACK_MIX = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0",
                "ffn_gate": "Q5_1", "ffn_up": "Q5_1", "ffn_down": "Q4_K", "output": "Q8_0"}
# a larger model's Q4_K_M: some layers' v in Q6_K beside q/k in Q4_K; here gate and up differ too
PARTS_MIX = {**PACKED_MIX, "attn_v": "Q6_K", "ffn_up": "Q4_K"}
DENSE_PARTS_MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q6_K",
                   "ffn_gate": "F16", "ffn_up": "Q4_K", "ffn_down": "Q5_0", "output": "Q8_0"}


@pytest.fixture(scope="module")
def kquant_gguf(tiny_model_factory, tmp_path_factory):
    def write(mix):
        path = tmp_path_factory.mktemp("kquant") / "tiny-k.gguf"
        write_gguf(tiny_model_factory("llama", **SHAPE), path, mix)
        return path
    return write


def _models(path, use_cache=False):
    packed = load_model(load_model_config(str(path), "cpu", quantization="auto", use_cache=use_cache), "cpu")
    dense = load_model(load_model_config(str(path), "cpu", quantization="none", use_cache=use_cache), "cpu")
    return packed, dense


def test_each_tensor_runs_packed_in_its_own_format_and_follows_the_dense_model(kquant_gguf):
    packed, dense = _models(kquant_gguf(PACKED_MIX))
    layer = packed.layers[0]
    kinds = [(type(m).__name__, getattr(m, "type_name", None)) for m in
             (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert kinds == [("KQuantLinear", "Q4_K"), ("Int8Linear", None), ("KQuantLinear", "Q5_K"), ("KQuantLinear", "Q6_K")]
    assert type(packed.lm_head).__name__ == "RescoredHead" and packed.lm_head.packed.type_name == "Q6_K"
    assert packed.decode_stack is not None  # every projection packed on stepahead's kernel, any format
    for name in ("qkv_proj", "o_proj"):
        assert torch.equal(getattr(layer.self_attn, name).dequantized_weight(),
                           getattr(dense.layers[0].self_attn, name).weight)
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(layer.mlp, name).dequantized_weight(), getattr(dense.layers[0].mlp, name).weight)
    prompt = list(range(40, 104))
    a, b = sequence_logits(packed, prompt), sequence_logits(dense, prompt)
    # bf16-rounded activations against float32 ones; measured max 0.4% of the largest logit
    assert float((a - b).abs().max()) < 0.02 * float(b.abs().max())
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.9
    assert greedy_tokens(packed, prompt[:8], 24) == greedy_tokens(dense, prompt[:8], 24)  # full passes


def test_the_engine_decodes_a_k_quant_file_as_the_dense_path_does(kquant_gguf, tiny_model_factory):
    """Through LLM: prefill, then decode steps on DecodeStack over Q4_K / Q8_0 / Q5_K / Q6_K projections,
    each row's greedy tokens the same in a batch and alone, and (random weights: near-tie logits, which
    bf16 activations flip now and then) nearly all equal to the dense float32 path's (measured: 63 of 64)."""
    from stepahead import LLM, SamplingParams

    path, tokenizer = kquant_gguf(PACKED_MIX), str(tiny_model_factory("llama", **SHAPE))
    prompts = [list(range(5 + 7 * i, 5 + 7 * i + 9 + i)) for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = {}
    for quantization in ("auto", "none"):
        with LLM(model=str(path), tokenizer=tokenizer, executor="uni", max_model_len=128,
                 quantization=quantization, model_cache=False) as llm:
            assert llm.config.model_config.quantization == ("gguf" if quantization == "auto" else "none")
            batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
            assert batch == alone
            outputs[quantization] = batch
    pairs = [(a, b) for packed, dense in zip(outputs["auto"], outputs["none"], strict=True)
             for a, b in zip(packed, dense, strict=True)]
    assert sum(a == b for a, b in pairs) >= 0.9 * len(pairs)
    assert [o[0] for o in outputs["auto"]] == [o[0] for o in outputs["none"]]


def test_q5_0_beside_q8_0_fuses_as_int8_codes_and_5_bit_codes_run_packed(kquant_gguf):
    packed, dense = _models(kquant_gguf(FALLBACK_MIX))
    layer, ref = packed.layers[0], dense.layers[0]
    assert type(layer.self_attn.qkv_proj).__name__ == "Int8Linear"  # q/k Q5_0 as int8 codes q - 16, v Q8_0
    assert layer.self_attn.o_proj.bits == 5 and layer.mlp.gate_up_proj.bits == 5  # Q5_0, Q5_1 records
    assert layer.mlp.down_proj.type_name == "Q4_K"
    for ours, theirs in ((layer.self_attn.qkv_proj, ref.self_attn.qkv_proj), (layer.self_attn.o_proj, ref.self_attn.o_proj),
                         (layer.mlp.gate_up_proj, ref.mlp.gate_up_proj), (layer.mlp.down_proj, ref.mlp.down_proj)):
        assert torch.equal(ours.dequantized_weight(), theirs.weight)
    assert packed.decode_stack is not None
    prompt = list(range(40, 104))
    a, b = sequence_logits(packed, prompt), sequence_logits(dense, prompt)
    assert float((a - b).abs().max()) < 0.02 * float(b.abs().max())


@pytest.mark.parametrize("mix", [PACKED_MIX, FALLBACK_MIX])
def test_the_model_cache_keeps_the_k_quant_codes(kquant_gguf, mix, tmp_path, monkeypatch):
    monkeypatch.setenv("STEPAHEAD_CACHE", str(tmp_path / "cache"))
    path = kquant_gguf(mix)
    direct = load_model(load_model_config(str(path), "cpu", quantization="auto", use_cache=False), "cpu")
    for _ in range(2):  # converted into the cache, then read back from it
        cached = load_model(load_model_config(str(path), "cpu", quantization="auto", use_cache=True), "cpu")
    assert any(p.name == "quantized_weights.st" for p in (tmp_path / "cache").rglob("*"))
    buffers = dict(direct.named_buffers())
    tiles = [name for name in buffers if name.endswith("tiles")]
    assert len(tiles) == 4 * len(direct.layers) + 1
    for name, value in cached.named_buffers():
        if name.endswith("tiles"):
            assert torch.equal(value, buffers[name]), name


def test_a_mixed_file_packs_what_has_a_kernel_and_keeps_the_rest_dense(kquant_gguf, caplog):
    packed, dense = _models(kquant_gguf(DENSE_PARTS_MIX))
    layer = packed.layers[0]
    # q/k Q4_K beside v Q6_K: two packed parts; gate F16 beside up Q4_K: the fused projection stays dense
    assert [p.type_name for p in layer.self_attn.qkv_proj.parts] == ["Q4_K", "Q6_K"]
    assert type(layer.mlp.gate_up_proj).__name__ == type(dense.layers[0].mlp.gate_up_proj).__name__
    assert type(layer.self_attn.o_proj).__name__ == "KQuantLinear"
    assert (type(layer.mlp.down_proj).__name__, layer.mlp.down_proj.bits) == ("Int4Linear", 5)  # Q5_0
    assert torch.equal(layer.mlp.down_proj.dequantized_weight(), dense.layers[0].mlp.down_proj.weight)
    assert type(packed.lm_head).__name__ == "RescoredHead"  # Q8_0 output
    assert packed.decode_stack is None
    prompt = list(range(3, 60))
    a, b = sequence_logits(packed, prompt), sequence_logits(dense, prompt)
    assert float((a - b).abs().max()) < 0.02 * float(b.abs().max())


def test_parts_packed_differently_run_side_by_side(kquant_gguf):
    packed, dense = _models(kquant_gguf(PARTS_MIX))
    layer, ref = packed.layers[0], dense.layers[0]
    assert [p.type_name for p in layer.self_attn.qkv_proj.parts] == ["Q4_K", "Q6_K"]  # q and k fused
    assert [p.type_name for p in layer.mlp.gate_up_proj.parts] == ["Q5_K", "Q4_K"]
    assert torch.equal(layer.self_attn.qkv_proj.dequantized_weight(), ref.self_attn.qkv_proj.weight)
    assert torch.equal(layer.mlp.gate_up_proj.dequantized_weight(), ref.mlp.gate_up_proj.weight)
    assert packed.decode_stack is not None
    prompt = list(range(40, 104))
    a, b = sequence_logits(packed, prompt), sequence_logits(dense, prompt)
    assert float((a - b).abs().max()) < 0.02 * float(b.abs().max())


@pytest.mark.parametrize("mix", [PACKED_MIX, PARTS_MIX, FALLBACK_MIX])
def test_a_decode_step_over_mixed_formats_in_one_call_is_the_layers_step_bitwise(kquant_gguf, mix):
    from stepahead.attention.rows import BatchRow
    from tests.kernels.test_cpu_decode_stack import _clone, _layers_step, _random_cache, _step

    model = load_model(load_model_config(str(kquant_gguf(mix)), "cpu", quantization="auto", use_cache=False), "cpu")
    assert model.decode_stack is not None
    rows = [BatchRow(0, 1, 5, [7]), BatchRow(1, 1, 17, [3, 12]), BatchRow(2, 1, 70, [20, 2, 9, 31, 14])]
    ids = torch.tensor([11, 22, 33])
    cache = _random_cache(model, 0)
    in_one_call, by_layers = _clone(cache), _clone(cache)
    assert torch.equal(_step(model, in_one_call, rows, ids), _layers_step(model, by_layers, rows, ids))
    for a, b in zip(in_one_call.k + in_one_call.v, by_layers.k + by_layers.v, strict=True):
        assert torch.equal(a, b)


_CAPPED_STEP = """
import sys, torch
from stepahead.attention.rows import BatchRow
from stepahead.kernels import cpu_packed
from stepahead.models.loading.loader import load_model, load_model_config
from tests.kernels.test_cpu_decode_stack import _random_cache, _step
model = load_model(load_model_config(sys.argv[1], "cpu", quantization="auto", use_cache=False), "cpu")
assert model.decode_stack is not None
rows = [BatchRow(i, 1, 3 + 5 * i, [i, 20 + i, 40 - i]) for i in range(int(sys.argv[2]))]
ids = torch.arange(11, 11 + len(rows))
torch.save((cpu_packed.instruction_set(), _step(model, _random_cache(model, 0, blocks=48), rows, ids)), sys.argv[3])
"""


@pytest.mark.parametrize("rows", [5, 9])
def test_a_decode_step_over_parts_packed_differently_is_the_same_on_every_instruction_set(kquant_gguf, rows,
                                                                                          tmp_path):
    """DecodeStack's projections (PackedParts of Q4_K beside Q6_K, Q5_K beside Q4_K) and packed head
    in this process and in processes capped at 256-bit VNNI and at AVX2: the same logits, bitwise."""
    import os
    import subprocess
    import sys

    from stepahead.kernels import cpu_packed

    if cpu_packed.instruction_set() == "avx2":
        pytest.skip("this process multiplies with AVX2: nothing wider to compare")
    path = kquant_gguf(PARTS_MIX)
    outputs = {}
    for cap in ("", "avx512_vnni", "avx2"):
        env = {k: v for k, v in os.environ.items() if k != "STEPAHEAD_MAX_CPU_ISA"}
        if cap:
            env["STEPAHEAD_MAX_CPU_ISA"] = cap
        out = tmp_path / f"step-{cap or 'widest'}.pt"
        subprocess.run([sys.executable, "-c", _CAPPED_STEP, str(path), str(rows), str(out)], env=env, check=True,
                       timeout=600)
        outputs[cap or "widest"] = torch.load(out)
    isas = [isa for isa, _ in outputs.values()]
    assert isas[1:] == ["avx512_vnni", "avx2"] and isas[0] == cpu_packed.instruction_set()
    widest = outputs["widest"][1]
    assert bool(widest.isfinite().all())
    for isa, logits in outputs.values():
        assert torch.equal(logits, widest), isa
