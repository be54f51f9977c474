"""`--quantization int4 | int8` on every family beside Llama's (Gemma 2 and 3, Phi-3, Qwen3-MoE,
Mixtral): each projection, experts included, runs packed, and the model's logits follow the same model
whose dense weights are the packed codes dequantized (so only the kernels' bf16 rounding of activations
separates them), and int8's follow the original float32 model within its rounding of the weights."""

from __future__ import annotations

import pytest
import torch

from stepahead.bench.full_forward import sequence_logits
from stepahead.models.loading.loader import load_model, load_model_config
from stepahead.models.moe import DenseExperts, MoeBlock, PackedExperts
from stepahead.models.quant.quantized_linear import Int4Linear, Int8Linear
from tests.tiny_models import GEMMA_ARCHS, MOE_ARCHS

FAMILIES = (*GEMMA_ARCHS, "phi3", *MOE_ARCHS)
LINEAR = {"int4": Int4Linear, "int8": Int8Linear}
# Relative to the largest reference logit: against the dequantized codes (activation rounding only),
# and against the original weights (int8's own rounding of the weights besides).
CODES_RTOL = 0.02
INT8_RTOL = 0.05


def _load(folder, quantization: str):
    return load_model(load_model_config(str(folder), "cpu", quantization=quantization), "cpu")


@torch.no_grad()
def _dense_twin_of_the_codes(packed, dense) -> int:
    """Write each packed projection's dequantized weight into the dense model's matching weight;
    returns how many projections were packed."""
    count = 0
    for name, module in packed.named_modules():
        if isinstance(module, (Int4Linear, Int8Linear)) and "experts" not in name:
            dense.get_submodule(name).weight.copy_(module.dequantized_weight())
            count += 1
        elif isinstance(module, PackedExperts):
            twin = dense.get_submodule(name)
            assert isinstance(twin, DenseExperts)
            for e in range(module.num_experts):
                twin.gate_up_proj[e].copy_(module.gate_up[e].dequantized_weight())
                twin.down_proj[e].copy_(module.down[e].dequantized_weight())
                count += 2
    return count


def _assert_same_choices_where_clear(logits: torch.Tensor, reference: torch.Tensor) -> None:
    """The argmax agrees at every position where the reference's top-2 margin is over twice the
    position's largest difference (a tiny random model has near-ties that activation rounding may
    flip), and that is most positions."""
    top2 = reference.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (logits - reference).abs().amax(-1)
    assert int(clear.sum()) > len(clear) // 2
    assert torch.equal(logits.argmax(-1)[clear], reference.argmax(-1)[clear])


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_packed_family_follows_its_dequantized_codes(tiny_model_factory, arch, mode):
    folder = tiny_model_factory(arch)
    prompt = list(range(3, 60))
    packed = _load(folder, mode)
    layer = packed.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, LINEAR[mode]) and isinstance(layer.self_attn.o_proj, LINEAR[mode])
    logits = sequence_logits(packed, prompt)

    twin = _load(folder, "none")
    assert _dense_twin_of_the_codes(packed, twin) >= 4 * len(packed.layers)
    if arch in MOE_ARCHS:  # a tiny model's experts move its logits little: compare the block itself
        blocks = [(name, m) for name, m in packed.named_modules() if isinstance(m, MoeBlock)]
        assert blocks and all(isinstance(m.experts, PackedExperts) for _, m in blocks)
        x = torch.randn(33, blocks[0][1].gate.in_features, generator=torch.Generator().manual_seed(0))
        for name, block in blocks:
            ref = twin.get_submodule(name)(x)
            assert float((block(x) - ref).abs().max()) < CODES_RTOL * float(ref.abs().max())
    reference = sequence_logits(twin, prompt)
    assert float((logits - reference).abs().max()) < CODES_RTOL * float(reference.abs().max())
    _assert_same_choices_where_clear(logits, reference)
    if mode == "int8":  # int4's rounding of tiny random weights moves logits by a third of their range
        original = sequence_logits(_load(folder, "none"), prompt)
        assert float((logits - original).abs().max()) < INT8_RTOL * float(original.abs().max())
