"""Dense float32 projections through oneDNN (models/onednn_linear.py): the same products as F.linear, the
plain weights replaced by oneDNN's layout, a tied head's embedding left plain for the lookup."""

from __future__ import annotations

import pytest
import torch

from stepahead.bench.full_forward import sequence_logits
from stepahead.models import onednn_linear
from stepahead.models.loading.loader import load_model, load_model_config
from stepahead.models.parallel_layers import ParallelLinear

pytestmark = pytest.mark.skipif(not onednn_linear.available("cpu", torch.float32), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 32, 200])
def test_linear_through_onednn_is_f_linear(rows):
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(rows, 64)
    reordered = onednn_linear.reorder(weight)
    assert reordered.is_mkldnn and reordered.shape == weight.shape
    for b in (bias, None):
        torch.testing.assert_close(onednn_linear.linear(x, reordered, b), torch.nn.functional.linear(x, weight, b),
                                   rtol=1e-5, atol=1e-5)
    # A view that is not contiguous (a slice of a wider activation) reads the same values.
    wide = torch.randn(rows, 80)
    torch.testing.assert_close(onednn_linear.linear(wide[:, 8:72], reordered, None),
                               torch.nn.functional.linear(wide[:, 8:72].contiguous(), weight), rtol=1e-5, atol=1e-5)
    assert onednn_linear.linear(x, weight, bias).equal(torch.nn.functional.linear(x, weight, bias))  # plain: torch's


@pytest.mark.parametrize("tied", [False, True])
def test_a_model_on_onednn_keeps_its_logits(tiny_model_factory, tied):
    model = load_model(load_model_config(str(tiny_model_factory("llama", tie_word_embeddings=tied)), "cpu",
                                         quantization="none"), "cpu")
    prompt = list(range(5, 70))
    before = sequence_logits(model, prompt)
    model.use_onednn()
    linears = [m for m in model.modules() if isinstance(m, ParallelLinear)]
    assert linears and all(m.weight.is_mkldnn for m in linears)
    if tied:  # the head multiplies by its own copy; the embedding looks rows up in the plain weight
        assert model.lm_head.onednn_weight.is_mkldnn and not model.embed_tokens.weight.is_mkldnn
    else:
        assert model.lm_head.onednn_weight is None and model.lm_head.weight.is_mkldnn
    after = sequence_logits(model, prompt)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4 * float(before.abs().max()))
