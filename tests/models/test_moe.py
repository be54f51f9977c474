"""The MoE block (models/moe.py): routing (ties, top-k normalisation), grouping by expert, and the block
against a per-token reference; the families' configs (models/moe_families.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stepahead.models.llama import LlamaForCausalLM
from stepahead.models.llama_args import check_parallel_sizes
from stepahead.models.moe import DenseExperts, ExpertGroups, MoeArgs, MoeBlock, grouped_swiglu, route
from stepahead.models.moe_families import mixtral_args, qwen3_moe_args


def test_ties_go_to_the_lower_expert_id():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 3.0, 0.0], [2.0, 1.0, 2.0, 2.0]])
    weights, ids = route(logits, 2, renormalize=True)
    assert ids.tolist() == [[0, 1], [1, 2], [0, 2]]
    assert weights[0].tolist() == [0.5, 0.5] and weights[1].tolist() == [0.5, 0.5]
    weights, ids = route(logits[:1], 3, renormalize=False)
    assert ids.tolist() == [[0, 1, 2]] and weights.tolist() == [[0.25, 0.25, 0.25]]


def test_renormalised_weights_are_the_softmax_over_the_top_k_logits():
    """Mixtral's definition; Qwen3-MoE without norm_topk_prob keeps the full softmax's probabilities."""
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    weights, ids = route(logits, 3, renormalize=True)
    torch.testing.assert_close(weights, torch.softmax(logits.gather(1, ids), dim=-1))
    assert (logits.gather(1, ids) >= logits.topk(3, dim=-1).values[:, -1:]).all()  # the three best
    raw, raw_ids = route(logits, 3, renormalize=False)
    assert torch.equal(raw_ids, ids)
    torch.testing.assert_close(raw, torch.softmax(logits, dim=-1).gather(1, ids))
    assert (raw.sum(-1) < 1).all()
    assert weights.dtype == raw.dtype == torch.float32


def test_groups_sort_each_tokens_choices_by_expert():
    ids = torch.tensor([[2, 0], [0, 3], [2, 1]])
    g = ExpertGroups.of(ids, 5)
    assert g.counts.tolist() == [2, 1, 2, 1, 0]
    assert ids.reshape(-1)[g.order].tolist() == [0, 0, 1, 2, 2, 3]
    assert g.rows.tolist() == [0, 1, 2, 0, 2, 1]


def _block(hidden: int, moe: MoeArgs, seed: int = 0) -> MoeBlock:
    torch.manual_seed(seed)
    block = MoeBlock(hidden, moe)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block


def _per_token_reference(block: MoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: the weighted sum of its experts' SwiGLU MLPs."""
    probs = torch.softmax(F.linear(x, block.gate.weight), dim=-1)
    out = torch.zeros_like(x)
    experts = block.experts
    assert isinstance(experts, DenseExperts)
    for t in range(x.shape[0]):
        top = probs[t].topk(block.top_k)
        w = top.values / top.values.sum() if block.renormalize else top.values
        for weight, e in zip(w.tolist(), top.indices.tolist(), strict=True):
            gate, up = F.linear(x[t], experts.gate_up_proj[e]).chunk(2)
            out[t] += weight * F.linear(F.silu(gate) * up, experts.down_proj[e])
    return out


@pytest.mark.parametrize("hidden, inter", [(32, 16), (30, 10)])
@pytest.mark.parametrize("top_k, renormalize", [(1, False), (2, True), (3, False)])
def test_the_block_is_the_per_token_sum_of_its_experts(hidden, inter, top_k, renormalize):
    """One product per expert with rows on CPU; an expert no token chose (8 experts, few tokens) is skipped."""
    moe = MoeArgs(num_experts=8, top_k=top_k, intermediate_size=inter, renormalize=renormalize, sparse_layers=(0,))
    block = _block(hidden, moe)
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(block(x), _per_token_reference(block, x), rtol=1e-5, atol=1e-5)
        # A token's result is its own, not its batch's: alone, it gets the same.
        torch.testing.assert_close(block(x[3:4]), block(x)[3:4], rtol=1e-6, atol=1e-6)


def test_bad_expert_counts_are_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        MoeArgs(num_experts=8, top_k=9, intermediate_size=16, renormalize=True, sparse_layers=())
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=18)
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        qwen3_moe_args("Qwen3MoeForCausalLM", {**cfg, "decoder_sparse_step": 0})
    a = qwen3_moe_args("Qwen3MoeForCausalLM", cfg)
    check_parallel_sizes(a, 2, 1)
    with pytest.raises(ValueError, match="experts' intermediate size 18"):
        check_parallel_sizes(a, 4, 1)


def test_the_configs_say_which_layers_are_sparse_and_how_weights_are_normalised():
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    q = qwen3_moe_args("Qwen3MoeForCausalLM", {**cfg, "decoder_sparse_step": 2, "mlp_only_layers": [3],
                                               "norm_topk_prob": True})
    assert q.moe is not None and q.moe.sparse_layers == (1, 5) and q.moe.renormalize and q.qk_norm
    assert q.moe.num_experts == 8 and q.moe.intermediate_size == 16
    m = mixtral_args("MixtralForCausalLM", cfg)
    assert m.moe is not None and m.moe.sparse_layers == tuple(range(6)) and m.moe.renormalize and not m.qk_norm
    assert m.moe.intermediate_size == 64  # Mixtral's experts are intermediate_size wide


def test_grouped_gemms_give_the_per_expert_products():
    """The CUDA path's two grouped calls, run here by torch's CPU implementation: each expert's rows
    (none for some) against that expert's weights."""
    gen = torch.Generator().manual_seed(2)
    experts = DenseExperts(4, 32, 16)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    x, counts = torch.randn(7, 32, generator=gen), torch.tensor([3, 0, 4, 0])
    grouped = grouped_swiglu(x, counts, experts.gate_up_proj.detach(), experts.down_proj.detach())
    torch.testing.assert_close(grouped, experts(x, counts).detach(), rtol=1e-6, atol=1e-6)


def test_only_grouped_experts_let_a_cuda_graph_hold_the_step():
    """Grouped: off the CPU in bfloat16 only (torch's grouped CUDA kernel), checked on the meta device,
    with rows 16-byte aligned. Otherwise experts read their row counts on the host."""
    assert not DenseExperts(4, 32, 16).to(torch.bfloat16).runs_grouped()  # CPU: one product per expert
    assert DenseExperts(4, 32, 16).to("meta", torch.bfloat16).runs_grouped()
    assert not DenseExperts(4, 32, 16).to("meta").runs_grouped()  # float32
    assert not DenseExperts(4, 36, 12).to("meta", torch.bfloat16).runs_grouped()  # rows of 36 and 12 halves
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    model = LlamaForCausalLM(mixtral_args("MixtralForCausalLM", cfg)).to("meta")
    assert not model.can_capture_graphs()
    model.to(torch.bfloat16)
    assert model.can_capture_graphs()
