"""Each rank loads its shard: safetensors and GGUF weights sliced at load time, layers of other stages
not held. No process groups are needed to load, so the ranks are built here in one process."""

from __future__ import annotations

import pytest
import torch

from stepahead.distributed.state import ParallelState
from stepahead.models.loading.loader import load_model, load_model_config
from stepahead.models.parallel_layers import ParallelLinear
from tests.models.gguf_writer import write_gguf


def _shards(model_config, tp: int, pp: int):
    return {(pp_rank, tp_rank): load_model(model_config, "cpu", ParallelState(tp, pp, tp_rank, pp_rank))
            for pp_rank in range(pp) for tp_rank in range(tp)}


def _check_shards(full, shards, tp: int, pp: int) -> None:
    a = full.args
    per_stage = a.num_layers // pp
    hd, q = a.head_dim, a.num_heads * a.head_dim // tp
    kv = a.num_kv_heads * hd // tp
    inter = a.intermediate_size // tp
    for (pp_rank, tp_rank), m in shards.items():
        assert len(m.layers) == per_stage
        assert (m.embed_tokens is not None) == (pp_rank == 0)
        assert (m.lm_head is not None) == (pp_rank == pp - 1)
        for i, layer in enumerate(m.layers):
            ref = full.layers[pp_rank * per_stage + i]
            full_qkv = ref.self_attn.qkv_proj.weight
            q_ref = full_qkv[tp_rank * q:(tp_rank + 1) * q]
            k_ref = full_qkv[a.num_heads * hd + tp_rank * kv:][:kv]
            v_ref = full_qkv[a.num_heads * hd + a.num_kv_heads * hd + tp_rank * kv:][:kv]
            assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([q_ref, k_ref, v_ref]))
            assert torch.equal(layer.self_attn.o_proj.weight, ref.self_attn.o_proj.weight[:, tp_rank * q:][:, :q])
            g, u = ref.mlp.gate_up_proj.weight.split(a.intermediate_size)
            assert torch.equal(layer.mlp.gate_up_proj.weight,
                               torch.cat([g[tp_rank * inter:][:inter], u[tp_rank * inter:][:inter]]))
            assert torch.equal(layer.mlp.down_proj.weight, ref.mlp.down_proj.weight[:, tp_rank * inter:][:, :inter])
            assert torch.equal(layer.input_layernorm.weight, ref.input_layernorm.weight)
        if m.lm_head is not None:
            rows = a.vocab_size // tp
            assert torch.equal(m.lm_head.shard_weight(), full.lm_head.shard_weight()[tp_rank * rows:][:rows])
        assert all(isinstance(mod, ParallelLinear) for name, mod in m.named_modules() if name.endswith("_proj"))


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_rank_shards_are_slices_of_the_whole_model(tiny_llama, tmp_path, fmt):
    path = str(tiny_llama)
    if fmt == "gguf":
        path = str(tmp_path / "tiny.gguf")
        write_gguf(tiny_llama, path)
    mc = load_model_config(path, "cpu", use_cache=False)
    assert mc.load_format == fmt
    full = load_model(mc, "cpu")
    _check_shards(full, _shards(mc, 2, 2), 2, 2)


def test_kv_heads_replicated_when_fewer_than_ranks(tiny_model_factory):
    """One KV head, two ranks: both hold it whole; the query heads are split."""
    folder = tiny_model_factory("llama", num_key_value_heads=1)
    mc = load_model_config(str(folder), "cpu")
    full = load_model(mc, "cpu")
    hd = full.args.head_dim
    for tp_rank in range(2):
        m = load_model(mc, "cpu", ParallelState(2, 1, tp_rank, 0))
        assert m.layers[0].self_attn.num_kv_heads == 1
        kv_ref = full.layers[0].self_attn.qkv_proj.weight[4 * hd:]
        assert torch.equal(m.layers[0].self_attn.qkv_proj.weight[2 * hd:], kv_ref)


@pytest.mark.parametrize("partition,expected", [(None, [[0, 1], [2]]), ((1, 2), [[0], [1, 2]])])
def test_uneven_stages_hold_their_layers(tiny_model_factory, partition, expected):
    """Three layers on two stages: the default split (2, 1), or the override's."""
    mc = load_model_config(str(tiny_model_factory("llama", num_hidden_layers=3)), "cpu")
    full = load_model(mc, "cpu")
    for pp_rank, layer_ids in enumerate(expected):
        m = load_model(mc, "cpu", ParallelState(1, 2, 0, pp_rank, layer_partition=partition))
        assert list(m.layer_range) == layer_ids and len(m.layers) == len(layer_ids)
        for layer, i in zip(m.layers, layer_ids, strict=True):
            assert torch.equal(layer.self_attn.qkv_proj.weight, full.layers[i].self_attn.qkv_proj.weight)
            assert torch.equal(layer.mlp.down_proj.weight, full.layers[i].mlp.down_proj.weight)
