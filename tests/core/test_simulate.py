"""`stepahead simulate` run in-process: a length finish, an EOS finish, and the waste at other depths."""

from __future__ import annotations

import argparse

import pytest

from stepahead.tools.simulate import add_parser


def _run(capsys, *argv: str) -> str:
    parser = argparse.ArgumentParser(prog="stepahead")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_case1_no_fifth_step(capsys):
    out = _run(capsys, "--prompt-len", "6", "--max-num-batched-tokens", "4", "--max-tokens", "3")
    lines = out.splitlines()
    assert lines[0].strip() == "schedule step 1: 4 token(s)  -> computed=4 known=6 placeholders=0"
    assert "schedule step 4: 1 token(s)  -> computed=8 known=7 placeholders=2" in out
    assert "schedule step 5: 1 token" not in out
    assert "output   step 4: token 3, finished (length)" in out
    assert "discarded" not in out
    assert lines[-1].strip() == "wasted forward passes for this request: 0"


def test_case2_eos_second_token_one_discarded(capsys):
    out = _run(capsys, "--max-tokens", "8", "--eos-at", "2")
    assert "output   step 3: token 2 = EOS, finished (stop)  -> known=8 placeholders=1" in out
    assert "output   step 4: request already finished, result discarded" in out
    assert out.count("discarded") == 1
    assert out.splitlines()[-1].strip() == "wasted forward passes for this request: 1"


@pytest.mark.parametrize("argv,wasted", [
    (["--eos-at", "1"], 1),  # EOS as the first token still wastes exactly one step
    (["--eos-at", "2", "--depth", "3"], 2),  # depth 3 wastes two
    (["--eos-at", "2", "--no-async-scheduling"], 0),
])
def test_eos_waste_by_depth(capsys, argv, wasted):
    out = _run(capsys, "--max-tokens", "8", *argv)
    assert out.count("result discarded") == wasted
    assert out.splitlines()[-1].strip() == f"wasted forward passes for this request: {wasted}"
    if "--no-async-scheduling" in argv:
        assert "placeholders=1" not in out


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit, match="--max-tokens must be >= 1"):
        _run(capsys, "--max-tokens", "0")


def test_core_is_torch_free():
    import subprocess
    import sys

    code = ("import sys, stepahead.core.scheduler, stepahead.core.async_scheduler, stepahead.engine.core, "
            "stepahead.tools.simulate, stepahead.tools.scripted_worker; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
