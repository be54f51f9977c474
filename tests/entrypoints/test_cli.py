"""The `stepahead` command, run as a real subprocess on a tiny model, and its engine flags."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stepahead import LLM, SamplingParams
from stepahead.engine.arg_utils import EngineArgs
from stepahead.entrypoints.cli import build_parser, main
from stepahead.entrypoints.engine_flags import add_engine_args, engine_args_from_namespace

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "def main(argv):"


def _stepahead(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "stepahead"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "stepahead.entrypoints.cli"]
    return subprocess.run(cmd + list(args), input=stdin, capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    with LLM(str(tiny_llama), executor="uni") as llm:
        params = SamplingParams(max_tokens=8, temperature=0.0)
        (gen,) = llm.generate(PROMPT, params, use_tqdm=False)
        (chat,) = llm.chat([{"role": "user", "content": "hello"}], params, use_tqdm=False)
    return gen.outputs[0].text, chat.outputs[0].text


def test_generate_prints_the_text(tiny_llama, reference):
    proc = _stepahead("generate", PROMPT, "--model", str(tiny_llama), "--max-tokens", "8", "--temperature", "0",
                      "--no-chat")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference[0] + "\n"


def test_generate_chat_by_default_n2_uni(tiny_llama, reference):
    # The tiny tokenizer has a chat template, so the prompt goes through it without --chat.
    proc = _stepahead("generate", "hello", "--model", str(tiny_llama), "-n", "2", "--max-tokens", "8",
                      "--temperature", "0", "--executor", "uni", "--no-async-scheduling")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(reference[1] + "\n") == 2 and "--- completion 1" in proc.stdout


def test_interactive_chat_streams_and_exits(tiny_llama, reference):
    proc = _stepahead("chat", str(tiny_llama), "--max-tokens", "8", "--temperature", "0", "--executor", "uni",
                      stdin="hello\nagain\n/exit\nnot read\n")
    assert proc.returncode == 0, proc.stderr
    replies = proc.stdout.split("> ")
    assert replies[1] == reference[1] + "\n"  # the first turn equals LLM.chat on the same message
    assert len(replies) == 4  # two replies, then the prompt that read /exit


def test_bad_argument_is_a_clear_error(tiny_llama):
    proc = _stepahead("generate", PROMPT, "--model", str(tiny_llama), "--max-tokens", "0", "--executor", "uni")
    assert proc.returncode == 2 and "max_tokens must be >= 1" in proc.stderr


def test_auto_tool_choice_needs_a_parser(tiny_llama):
    proc = _stepahead("serve", str(tiny_llama), "--host", "127.0.0.1", "--port", "0", "--enable-auto-tool-choice")
    assert proc.returncode == 2 and "--enable-auto-tool-choice requires --tool-call-parser" in proc.stdout + proc.stderr


def test_unsupported_architecture_names_it_and_the_supported_list(tiny_llama, tmp_path):
    import json
    import shutil

    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    message = r"'GPT2LMHeadModel' is not supported \(supported: LlamaForCausalLM, .*Phi3ForCausalLM"
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), executor="uni")
    proc = _stepahead("serve", str(folder), "--host", "127.0.0.1", "--port", "0")
    assert proc.returncode != 0
    assert re.search(message, proc.stdout + proc.stderr), proc.stdout + proc.stderr


def test_engine_failure_is_an_error_message_and_status_1(tiny_model_factory, tmp_path, capsys):
    """stepahead's own failures (here the worker's, at startup) are caught by type: exit status 1, no traceback
    of the CLI (the message carries the worker's)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(tiny_model_factory("llama"), folder)
    weights = load_file(folder / "model.safetensors")
    del weights["lm_head.weight"]  # the config still reads; loading the weights in the worker fails
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["generate", PROMPT, "--model", str(folder), "--executor", "mp"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: stepahead worker process failed to start") and "missing 1 weights" in err


def test_engine_flags_use_vllm_spelling():
    parser = add_engine_args(argparse.ArgumentParser())
    ns = parser.parse_args(["m", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--block-size", "32",
                            "--num-kv-blocks", "99", "--no-async-scheduling", "--no-enable-prefix-caching",
                            "--no-enable-chunked-prefill", "--max-model-len", "512", "--dtype", "bfloat16",
                            "--seed", "3", "--load-format", "dummy", "--executor", "uni",
                            "--max-concurrent-batches", "3"])
    args = engine_args_from_namespace(ns)
    assert args == EngineArgs(model="m", max_num_seqs=4, max_num_batched_tokens=64, block_size=32, num_kv_blocks=99,
                              async_scheduling=False, enable_prefix_caching=False, enable_chunked_prefill=False,
                              max_model_len=512, dtype="bfloat16", seed=3, load_format="dummy", executor="uni",
                              max_concurrent_batches=3)
    assert engine_args_from_namespace(parser.parse_args([])) == EngineArgs()
    assert engine_args_from_namespace(parser.parse_args(["--async-scheduling"])).async_scheduling is True
    assert engine_args_from_namespace(parser.parse_args(["--model", "x"])).model == "x"
    with pytest.raises(SystemExit):
        parser.parse_args(["--executor", "ray"])


def test_every_engine_arg_is_a_flag():
    parser = add_engine_args(argparse.ArgumentParser())
    dests = {a.dest for a in parser._actions}
    assert set(EngineArgs.field_names()) - {"model"} <= dests


def _leaf_commands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None:
        return {prefix.strip(): parser}
    leaves = {}
    for name, child in sub.choices.items():
        leaves |= _leaf_commands(child, f"{prefix} {name}")
    return leaves


def test_subcommands_registered():
    leaves = _leaf_commands(build_parser())
    assert {"generate", "chat"} <= set(leaves)
    for name, parser in leaves.items():
        assert callable(parser.get_default("func")), name


@pytest.mark.parametrize("command", ["serve", "bench throughput", "bench latency"])
def test_trace_file_flag_replaces_the_engine_switch(command):
    parser = _leaf_commands(build_parser())[command]
    text = parser.format_help()
    assert "--trace FILE.json" in text and "--no-trace" not in text
    ns = parser.parse_args(["--trace", "t.json"])
    assert ns.trace_file == "t.json" and engine_args_from_namespace(ns).trace is False
