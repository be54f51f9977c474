"""The model cache: a GGUF file is converted once and read from the cache afterwards, with the same
weights and tokens; damaged entries are rebuilt; two processes converting at once both succeed."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stepahead.models.loading import gguf_loader, model_cache
from stepahead.models.loading.loader import load_model, load_model_config
from stepahead.worker.model_runner import ModelRunner
from tests.models.gguf_writer import write_gguf
from tests.tiny_models import hf_greedy
from tests.worker.driver import MiniSched, make_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def gguf_file(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("STEPAHEAD_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_llama, path)
    return path


def _params(model_config) -> dict[str, torch.Tensor]:
    return dict(load_model(model_config, "cpu").named_parameters())


def test_converted_once_then_read_from_the_cache(gguf_file, tiny_llama, monkeypatch):
    first = load_model_config(str(gguf_file), "cpu")
    entry = Path(first.converted)
    assert entry.parent == Path(model_cache.cache_root()) and first.load_format == "gguf"
    assert {p.name for p in entry.iterdir()} == {"config.json", "model.safetensors", "manifest.json"}
    assert model_cache.entry_problem(entry) is None

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_loader, "convert_to_folder", no_conversion)
    monkeypatch.setattr(gguf_loader, "read_gguf_config", no_conversion)  # not even the metadata is parsed
    again = load_model_config(str(gguf_file), "cpu")
    assert again == first
    monkeypatch.undo()
    monkeypatch.setenv("STEPAHEAD_CACHE", "off")
    uncached = load_model_config(str(gguf_file), "cpu")
    assert uncached.converted is None
    cached_params, fresh_params = _params(again), _params(uncached)
    for name, value in fresh_params.items():
        assert torch.equal(cached_params[name], value), name
    prompt = list(range(50, 90))
    sched = MiniSched(ModelRunner(make_config(gguf_file, block_size=16)), 16)
    sched.add("r", prompt, 6)
    assert sched.run()["r"] == hf_greedy(tiny_llama, [prompt], 6)[0]


def test_use_cache_false_and_dummy_skip_the_cache(gguf_file):
    assert load_model_config(str(gguf_file), "cpu", use_cache=False).converted is None
    assert load_model_config(str(gguf_file), "cpu", load_format="dummy").converted is None
    assert not Path(model_cache.cache_root()).exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest"])
def test_a_damaged_entry_is_rebuilt_with_a_warning(gguf_file, damage, caplog):
    entry = Path(load_model_config(str(gguf_file), "cpu").converted)
    expected = _params(load_model_config(str(gguf_file), "cpu"))
    weights = entry / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "flip":
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0xFF
        weights.write_bytes(bytes(data))
    else:
        (entry / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="stepahead.models.loading.model_cache"):
        rebuilt = load_model_config(str(gguf_file), "cpu")
    assert "damaged" in caplog.text and "rebuilding" in caplog.text
    assert model_cache.entry_problem(Path(rebuilt.converted)) is None
    for name, value in _params(rebuilt).items():
        assert torch.equal(expected[name], value), name


def test_a_changed_source_gets_a_new_entry(gguf_file, tiny_model_factory):
    first = load_model_config(str(gguf_file), "cpu").converted
    write_gguf(tiny_model_factory("llama", hidden_size=128), gguf_file)
    second = load_model_config(str(gguf_file), "cpu")
    assert second.converted != first and second.hf_config["hidden_size"] == 128


def test_two_processes_converting_at_once_both_succeed(gguf_file):
    script = ("import sys; from stepahead.models.loading.loader import load_model_config; "
              "print(load_model_config(sys.argv[1], 'cpu').converted)")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(gguf_file)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [proc.communicate(timeout=300) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), results
    entries = {out.strip() for out, _ in results}
    assert len(entries) == 1
    (entry,) = entries
    assert model_cache.entry_problem(Path(entry)) is None
    assert [p.name for p in Path(model_cache.cache_root()).iterdir()] == [Path(entry).name]  # no temp left
