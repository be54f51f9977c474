"""Loader: config resolution, bad input, GGUF round trip against the safetensors twin, the built-in model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from stepahead.models.loading.loader import load_model, load_model_config, load_tokenizer
from stepahead.sampling_params import SamplingParams
from stepahead.worker.model_runner import ModelRunner
from tests.models.gguf_writer import write_gguf
from tests.tiny_models import hf_greedy
from tests.worker.driver import MiniSched, make_config


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_config_from_folder(tiny_llama):
    mc = load_model_config(str(tiny_llama), "cpu")
    assert (mc.architecture, mc.dtype, mc.max_model_len, mc.vocab_size) == ("LlamaForCausalLM", "float32", 512, 2048)
    assert (mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.eos_token_id) == (2, 2, 16, 2)
    assert load_model_config(str(tiny_llama), "cpu", max_model_len=100).max_model_len == 100
    assert load_model_config(str(tiny_llama), "cuda").dtype == "bfloat16"
    assert load_tokenizer(mc).eos_token_id == 2


def test_bad_inputs(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="max_model_len"):
        load_model_config(str(tiny_llama), "cpu", max_model_len=513)
    with pytest.raises(ValueError, match="does not exist"):
        load_model_config(str(tmp_path / "nope"), "cpu")
    bad_arch = _copy(tiny_llama, tmp_path / "arch")
    cfg = json.loads((bad_arch / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad_arch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        load_model_config(str(bad_arch), "cpu")
    missing = _copy(tiny_llama, tmp_path / "missing")
    (missing / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model_config(str(missing), "cpu")
    corrupt = _copy(tiny_llama, tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ValueError, match="safetensors"):
        load_model_config(str(corrupt), "cpu")
    ntk = _copy(tiny_llama, tmp_path / "ntk")
    cfg = json.loads((ntk / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "ntk", "factor": 4.0, "rope_theta": 10000.0}
    (ntk / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_scaling type 'ntk' is not supported.*yarn, dynamic, longrope"):
        load_model_config(str(ntk), "cpu")
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0}
    (ntk / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_scaling of type 'yarn' lacks the field 'factor'"):
        load_model_config(str(ntk), "cpu")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF garbage")
    with pytest.raises(ValueError, match="GGUF"):
        load_model_config(str(tmp_path / "junk.gguf"), "cpu")


def test_missing_tensor_is_reported(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny_llama, tmp_path / "partial")
    sd = load_file(str(folder / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    mc = load_model_config(str(folder), "cpu")
    with pytest.raises(ValueError, match="missing 1 weights"):
        load_model(mc, "cpu")


def test_dummy_weights_have_model_shape(tiny_llama):
    mc = load_model_config(str(tiny_llama), "cpu", load_format="dummy")
    model = load_model(mc, "cpu")
    assert model.embed_tokens.weight.shape == (2048, 64) and model.embed_tokens.weight.std() > 0


def test_gguf_matches_safetensors_twin(tiny_llama, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_llama, path)
    g_cfg = load_model_config(str(path), "cpu")
    s_cfg = load_model_config(str(tiny_llama), "cpu")
    assert (g_cfg.load_format, g_cfg.eos_token_id, g_cfg.head_dim) == ("gguf", 2, s_cfg.head_dim)
    g, s = load_model(g_cfg, "cpu"), load_model(s_cfg, "cpu")
    for (n, a), (_, b) in zip(g.named_parameters(), s.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    x = torch.randn(3, 64)
    assert torch.equal(g.compute_logits(x), s.compute_logits(x))
    prompt = list(range(50, 90))
    sched = MiniSched(ModelRunner(make_config(path, block_size=16)), 16)
    sched.add("r", prompt, 6)
    assert sched.run()["r"] == hf_greedy(tiny_llama, [prompt], 6)[0]


def test_builtin_model_answers_paris():
    mc = load_model_config(None, "cpu")
    assert (mc.hf_config["hidden_size"], mc.num_layers, mc.vocab_size) == (576, 30, 49152)
    assert mc.hf_config["tie_word_embeddings"] and mc.load_format == "gguf"
    tok = load_tokenizer(mc)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    runner = ModelRunner(make_config(mc.model, block_size=16, num_blocks=80, max_model_len=1024))
    sched = MiniSched(runner, 16)
    sched.add("q", ids, 12, SamplingParams(temperature=0.0))
    text = tok.decode(sched.run()["q"])
    assert "Paris" in text, text
