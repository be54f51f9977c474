"""Hugging Face ids from a local hub cache (offline), the model's generation_config.json defaults
(offline API, CLI flags and the server, in both --generation-config modes) and --chat-template."""

from __future__ import annotations

import dataclasses
import json
import shutil

import httpx
import pytest

from stepahead import LLM, SamplingParams
from stepahead.models.loading.loader import load_model_config, load_tokenizer
from tests.entrypoints.openai.server_utils import RemoteServer

REPO_ID = "tiny-org/tiny-llama"
COMMITS = {"main": "a" * 40, "v1": "b" * 40}


@pytest.fixture
def hub_cache(tiny_llama, tmp_path, monkeypatch):
    """A Hugging Face hub cache holding REPO_ID at two revisions (the layout huggingface_hub writes)."""
    repo = tmp_path / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    for ref, commit in COMMITS.items():
        shutil.copytree(tiny_llama, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def test_hub_id_resolves_from_the_cache_offline(hub_cache):
    config = load_model_config(REPO_ID, "cpu", download_dir=str(hub_cache))
    assert config.model.endswith(f"snapshots/{COMMITS['main']}") and config.served_model_name == REPO_ID
    pinned = load_model_config(REPO_ID, "cpu", download_dir=str(hub_cache), revision="v1")
    assert pinned.model.endswith(f"snapshots/{COMMITS['v1']}")


@pytest.mark.parametrize("model", ["tiny-org/not-there", "nobody/tiny-llama"])
def test_unknown_id_offline_fails_in_one_clear_line(hub_cache, model):
    with pytest.raises(ValueError) as err:
        load_model_config(model, "cpu", download_dir=str(hub_cache))
    message = str(err.value)
    assert model in message and "HF_HUB_OFFLINE" in message and "\n" not in message


def test_serve_a_hub_id_offline(hub_cache):
    """`stepahead serve ORG/NAME` with HF_HOME's cache and no network."""
    (hub_cache.parent / "home").mkdir()
    shutil.move(str(hub_cache), str(hub_cache.parent / "home" / "hub"))
    server = RemoteServer(REPO_ID, "--num-kv-blocks", "64", "--executor", "uni",
                          env={"HF_HOME": str(hub_cache.parent / "home"), "HF_HUB_OFFLINE": "1"})
    try:
        models = httpx.get(server.base_url + "/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [REPO_ID]
        reply = httpx.post(server.base_url + "/completions", timeout=60,
                           json={"model": REPO_ID, "prompt": "hello", "max_tokens": 3, "temperature": 0}).json()
        assert reply["usage"]["completion_tokens"] == 3
        assert "Ready on http://127.0.0.1:" in server.log and "KV cache 1008 tokens (63 blocks of 16)" in server.log
    finally:
        server.stop()


@pytest.fixture
def model_with_defaults(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "with-defaults")
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_p": 0.9, "max_new_tokens": 5, "do_sample": True, "bos_token_id": 1}))
    return folder


def test_generation_config_defaults_offline(model_with_defaults):
    auto = load_model_config(str(model_with_defaults), "cpu")
    assert auto.generation_defaults == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5}
    assert load_model_config(str(model_with_defaults), "cpu", generation_config="vllm").generation_defaults == {}
    prompt = {"prompt_token_ids": list(range(40, 60))}
    with LLM(str(model_with_defaults), executor="uni") as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.0, 0.9, 5)
        (out,) = llm.generate(prompt, use_tqdm=False)  # no params: the model's defaults
        greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == greedy.outputs[0].token_ids
    with LLM(str(model_with_defaults), executor="uni", generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
        (out,) = llm.generate(prompt, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == SamplingParams().max_tokens


def test_generation_config_defaults_on_the_server(model_with_defaults):
    for mode, expected_tokens in (("auto", 5), ("vllm", 2)):
        server = RemoteServer(model_with_defaults, "--num-kv-blocks", "64", "--executor", "uni",
                              "--generation-config", mode)
        try:
            body = {"model": model_with_defaults.name, "prompt": "hello world", "ignore_eos": True}
            if mode == "vllm":
                body["max_tokens"] = 2
            runs = [httpx.post(server.base_url + "/completions", json=body, timeout=60).json() for _ in range(2)]
            assert all(r["usage"]["completion_tokens"] == expected_tokens for r in runs)
            if mode == "auto":  # temperature 0 from the file: the two runs agree
                assert runs[0]["choices"][0]["text"] == runs[1]["choices"][0]["text"]
                assert "generation_config.json: temperature=0.0, top_p=0.9, max_tokens=5" in server.log
        finally:
            server.stop()


def test_chat_template_override(tiny_llama, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>>>")
    config = load_model_config(str(tiny_llama), "cpu", chat_template=str(template))
    rendered = load_tokenizer(config).apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "[user] hi\n>>>"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_model_config(str(tiny_llama), "cpu", chat_template=str(tmp_path / "missing.jinja"))


def test_cli_flags_override_the_model_defaults():
    import argparse

    from stepahead.entrypoints.cli import sampling_params_from_namespace

    defaults = SamplingParams(temperature=0.0, top_p=0.9, max_tokens=5)
    ns = argparse.Namespace(max_tokens=7, temperature=None, top_p=0.5, top_k=None, seed=3)
    params = sampling_params_from_namespace(ns, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.seed) == (0.0, 0.5, 0, 7, 3)
    assert sampling_params_from_namespace(ns).temperature == 1.0  # no model defaults: vLLM's


def test_every_end_token_stops_a_request(tiny_llama, tmp_path):
    """config.json's or generation_config.json's list of end tokens: each one stops a request (as
    Llama 3's <|eot_id|> must), unless ignore_eos."""
    prompt = {"prompt_token_ids": list(range(40, 60))}
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    with LLM(str(tiny_llama), executor="uni") as llm:
        free = llm.generate(prompt, dataclasses.replace(greedy, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    third = free.token_ids[2]
    folder = shutil.copytree(tiny_llama, tmp_path / "two-ends")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, third]}))
    config = load_model_config(str(folder), "cpu")
    assert config.eos_token_id == 2 and config.extra_eos_token_ids == (third,)
    with LLM(str(folder), executor="uni") as llm:
        (out,) = llm.generate(prompt, greedy, use_tqdm=False)
        assert out.outputs[0].token_ids == free.token_ids[:3] and out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].stop_reason is None  # an end token, as EOS: not a stop_token_ids hit
        (kept,) = llm.generate(prompt, dataclasses.replace(greedy, ignore_eos=True), use_tqdm=False)
        assert kept.outputs[0].token_ids == free.token_ids
