"""Every Triton kernel variant the engine launches (attention, KV write, the layers' fused norm and rope
kernels) compiles for sm_90 (H100/H200) with Triton's bundled ptxas, without register spills; no GPU
needed (stepahead/attention/triton_aot.py).

CI compiles a representative subset (every kernel and launch kind; about 15 s here); with
STEPAHEAD_AOT_FULL=1 the whole matrix (~150 variants, about a minute on two cores). Run with -s to see
the registers of each kernel:

    STEPAHEAD_AOT_FULL=1 pytest -s tests/attention/test_triton_aot.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from stepahead.attention import triton_aot, triton_paged

REPO = Path(__file__).resolve().parents[2]
FULL = os.environ.get("STEPAHEAD_AOT_FULL") == "1"
KINDS = {"write_kv", "decode", "merge", "prefill", "rope", "qk_norm_rope", "add_rms_norm"}


def test_the_full_matrix_names_every_variant():
    labels = {v.label for v in triton_aot.variants(full=True)}
    for dtype in ("fp16", "bf16", "fp32"):
        for head_dim in (64, 128):
            for block_size in (1, 16, 128):
                base = f"{dtype} hd{head_dim} bs{block_size}"
                assert {f"write_kv {base}", f"prefill {base}"} <= labels
                assert {f"decode {base} splits{n}" for n in triton_paged.KV_SPLIT_CHOICES} <= labels
            assert {f"merge {dtype} hd{head_dim} splits{n}" for n in triton_paged.KV_SPLIT_CHOICES if n > 1} <= labels
        for head_dim in (64, 128):
            assert {f"rope {dtype} hd{head_dim}", f"qk_norm_rope {dtype} hd{head_dim}"} <= labels
    assert {"add_rms_norm fp32 hidden1024", "add_rms_norm bf16 hidden576"} <= labels
    subset = {v.label.split()[0] for v in triton_aot.variants(full=False)}
    assert subset == KINDS


def test_kernels_compile_for_sm90_without_spills():
    # In a process of its own: the suite runs Triton interpreted, and compiling needs real JIT functions.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO)
    args = [sys.executable, "-m", "stepahead.attention.triton_aot", *(["--full"] if FULL else [])]
    proc = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    print(proc.stdout)  # the table: registers, spills and shared memory per kernel variant
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    expected = len(list(triton_aot.variants(FULL)))
    assert len(rows) == expected and {row[0] for row in rows} == KINDS
    # A spill would print SPILLS and fail the run above; registers stay within a thread's 255.
    assert all(0 < int(row[-4]) <= 255 and row[-3] == "0/0" for row in rows)
