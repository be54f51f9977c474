"""The server refuses, before the model loads, parsers whose markers the tokenizer cannot write as the
single tokens they need (parser_tokens.py); the configurations that can work pass, and say which requests
must keep special tokens in their output text."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stepahead.entrypoints.openai.api_server import checked_tokenizer
from stepahead.entrypoints.openai.parser_tokens import parser_tokens
from stepahead.entrypoints.openai.tool_calling.parsers import TOOL_PARSERS
from stepahead.models.loading.loader import load_model_config
from tests.entrypoints.openai.tool_parser_checks import family_tokenizer

REPO = Path(__file__).resolve().parents[3]


def test_the_built_in_model_cannot_think_in_think_tags():
    """SmolLM2's tokenizer spells <think> in three tokens: the reasoning gate would wait for ever."""
    with pytest.raises(ValueError, match="--reasoning-parser qwen3 needs .*<think> and </think> as single tokens"):
        checked_tokenizer(load_model_config(None, "cpu"), None, "qwen3")


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_think_tags_as_added_tokens_pass(tokenizer_folder, parser):
    tokenizer = family_tokenizer(tokenizer_folder, added=["<think>", "</think>"])
    start, end = (tokenizer.convert_tokens_to_ids(marker) for marker in ("<think>", "</think>"))
    tokens = parser_tokens(tokenizer, None, parser)
    assert tokens.reasoning_end == [end]
    assert tokens.reasoning_start == (None if parser == "deepseek_r1" else [start])
    assert not tokens.reasoning_keeps_special and not tokens.tools_keep_special


def test_magistral_markers_are_special_tokens_the_output_keeps(tokenizer_folder):
    tokenizer = family_tokenizer(tokenizer_folder, special=["[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]"])
    tokens = parser_tokens(tokenizer, "mistral", "mistral")
    assert tokens.reasoning_keeps_special and tokens.tools_keep_special
    assert tokens.reasoning_start == [tokenizer.convert_tokens_to_ids("[THINK]")]
    with pytest.raises(ValueError, match=r"--reasoning-parser mistral needs .*\[THINK\] and \[/THINK\]"):
        parser_tokens(family_tokenizer(tokenizer_folder), None, "mistral")


@pytest.mark.parametrize("parser, tokens", [("mistral", ["[TOOL_CALLS]"]),
                                            ("qwen3_coder", ["<tool_call>", "</tool_call>"]),
                                            ("qwen3_xml", ["<tool_call>", "</tool_call>"])])
def test_tool_parsers_that_need_their_tokens(tokenizer_folder, parser, tokens):
    with pytest.raises(ValueError, match=f"--tool-call-parser {parser} needs"):
        parser_tokens(family_tokenizer(tokenizer_folder), parser, None)
    assert not parser_tokens(family_tokenizer(tokenizer_folder, added=tokens), parser, None).tools_keep_special


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic", "phi4_mini_json"])
def test_tool_parsers_read_as_text_need_no_token(tokenizer_folder, parser):
    """SmolLM2 writes hermes's <tool_call> as text; pythonic and phi4_mini_json have no marker token."""
    assert TOOL_PARSERS[parser].REQUIRED_TOKENS == ()
    assert parser_tokens(family_tokenizer(tokenizer_folder), parser, None).tools_keep_special is False
    special = family_tokenizer(tokenizer_folder, special=["<tool_call>", "</tool_call>"])
    assert parser_tokens(special, parser, None).tools_keep_special is (parser == "hermes")


def test_serve_refuses_before_loading_the_model(tiny_llama):
    """The tiny models' tokenizer has no think tokens either: `stepahead serve` exits with the reason."""
    proc = subprocess.run([sys.executable, "-m", "stepahead.entrypoints.cli", "serve", str(tiny_llama), "--port", "0",
                           "--reasoning-parser", "qwen3"], capture_output=True, text=True, timeout=300, cwd=REPO)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Invalid configuration: --reasoning-parser qwen3 needs the tokenizer to hold <think> and </think>" in output
