"""The decode kernel on AVX-512's 16-float vectors (paged_decode_avx512.cpp, asked for with
STEPAHEAD_CPU_ATTENTION=avx512, so run in a process of its own) against the same kernel in a process
capped at AVX2 (STEPAHEAD_MAX_CPU_ISA=avx2): decode rows, prompt tiles, sliding windows, logit
caps, three cache types, query-head groups of 1 to 5; each within float rounding of float64 and of
the other, bitwise the same where heads are not a multiple of 64 floats (both run AVX2's loops); and
on the wide path each row's bits are its own, whatever the rows beside it and its place among them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from stepahead.kernels import cpu_build

needs_kernels = pytest.mark.skipif(not cpu_build.machine_can_build(), reason="needs an AVX2 CPU and a C++ compiler")

_RUN = """
import sys, torch
from stepahead.kernels import cpu_ops
from tests.kernels.test_paged_decode_isa import _attend
jobs = torch.load(sys.argv[1])
outs = [_attend(c, rows) for c, rows in jobs]
torch.save((cpu_ops.attention_instruction_set(), outs), sys.argv[2])
"""


def _case(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, lens: list[int],
          shared_table: bool = False, window: int = 0, softcap: float = 0.0) -> dict:
    """Rows of `lens` keys over scattered blocks (one table for all rows where shared_table: a prompt's
    tokens, which the kernel computes in tiles)."""
    width = -(-max(lens) // block_size)
    tables = 1 if shared_table else len(lens)
    k, v = torch.randn(2, kv_heads, tables * width + 1, block_size, head_dim).to(dtype).unbind(0)
    table = (torch.randperm(tables * width) + 1).view(tables, width).expand(len(lens), width).contiguous()
    return {"q": torch.randn(len(lens), heads, head_dim), "k": k.contiguous(), "v": v.contiguous(), "table": table,
            "lens": torch.tensor(lens), "scale": head_dim ** -0.5, "window": window, "softcap": softcap}


def _attend(c: dict, rows: slice | list[int] | None = None) -> torch.Tensor:
    from stepahead.kernels import cpu_ops

    pick = slice(None) if rows is None else rows
    q = c["q"][pick]
    out = torch.empty_like(q)
    cpu_ops.paged_decode_attention(q, c["k"], c["v"], c["table"][pick], c["lens"][pick], c["scale"], out, c["window"],
                                   c["softcap"])
    return out


def _float64(c: dict) -> torch.Tensor:
    """softmax(cap(q k^T scale)) v over each row's window, in float64 over the cache's values."""
    kv_heads, _, block_size, head_dim = c["k"].shape
    heads = c["q"].shape[1]
    out = torch.empty(c["q"].shape, dtype=torch.float64)
    for r, n in enumerate(c["lens"].tolist()):
        lo = max(0, n - c["window"]) if c["window"] else 0
        keys = c["k"][:, c["table"][r]].reshape(kv_heads, -1, head_dim)[:, lo:n].double()
        values = c["v"][:, c["table"][r]].reshape(kv_heads, -1, head_dim)[:, lo:n].double()
        qr = c["q"][r].double().view(kv_heads, heads // kv_heads, head_dim)
        scores = qr @ keys.transpose(1, 2) * c["scale"]
        if c["softcap"]:
            scores = torch.tanh(scores / c["softcap"]) * c["softcap"]
        out[r] = (torch.softmax(scores, -1) @ values).reshape(heads, head_dim)
    return out


def _run_apart(jobs: list[tuple[dict, list[int] | None]], tmp_path, **env: str) -> tuple[str, list]:
    """Each (case, rows) attended in a process of its own with `env` set: its instruction set, the outputs."""
    torch.save(jobs, tmp_path / "jobs.pt")
    subprocess.run([sys.executable, "-c", _RUN, str(tmp_path / "jobs.pt"), str(tmp_path / "outs.pt")],
                   env={**os.environ, **env}, check=True, timeout=600)
    return torch.load(tmp_path / "outs.pt")


def _capped_at_avx2(cases: list[dict], tmp_path) -> list[torch.Tensor]:
    isa, outs = _run_apart([(c, None) for c in cases], tmp_path, STEPAHEAD_MAX_CPU_ISA="avx2")
    assert isa == "avx2"
    return outs


def _on_avx512(jobs: list[tuple[dict, list[int] | None]], tmp_path) -> list[torch.Tensor]:
    isa, outs = _run_apart(jobs, tmp_path, STEPAHEAD_CPU_ATTENTION="avx512")
    if isa != "avx512":
        pytest.skip("needs a CPU with AVX-512, where the kernel attends on 16-float vectors")
    return outs


DECODE_LENS = [1, 7, 8, 9, 16, 40, 77, 300]
PROMPT_LENS = list(range(21, 58))  # a prompt's 37 tokens after 20 cached: tiles of up to eight rows


@needs_kernels
def test_avx512_and_avx2_agree_within_rounding_and_are_the_same_code_off_64_float_heads(tmp_path):
    torch.manual_seed(0)
    wide = [
        _case(9, 3, 64, 16, torch.float16, DECODE_LENS),
        _case(9, 3, 64, 16, torch.float16, PROMPT_LENS, shared_table=True),
        _case(9, 3, 64, 16, torch.float16, DECODE_LENS, window=24, softcap=5.0),
        _case(9, 3, 64, 16, torch.float16, PROMPT_LENS, shared_table=True, window=11, softcap=5.0),
        _case(8, 2, 128, 32, torch.bfloat16, DECODE_LENS),  # groups of four: one pass on AVX-512
        _case(10, 2, 64, 8, torch.float32, DECODE_LENS),  # groups of five: 4 + 1 (AVX2: 3 + 2)
        _case(4, 4, 64, 16, torch.float32, PROMPT_LENS, shared_table=True),
        _case(6, 2, 64, 5, torch.float16, DECODE_LENS),  # blocks of 5: one key at a time
    ]
    narrow = [_case(6, 2, 80, 16, dtype, DECODE_LENS) for dtype in (torch.float16, torch.float32)]
    here = _on_avx512([(c, None) for c in wide + narrow], tmp_path)
    avx2 = _capped_at_avx2(wide + narrow, tmp_path)
    for c, ours, theirs in zip(wide, here[:len(wide)], avx2[:len(wide)], strict=True):
        reference = _float64(c)
        torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(theirs.double(), reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # the 16-lane sums round differently somewhere: the two processes did run different loops
    assert any(not torch.equal(ours, theirs) for ours, theirs in zip(here[:len(wide)], avx2[:len(wide)], strict=True))
    for ours, theirs in zip(here[len(wide):], avx2[len(wide):], strict=True):
        assert torch.equal(ours, theirs)


@needs_kernels
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (24, 5.0)])
def test_on_avx512_a_rows_bits_do_not_depend_on_the_rows_beside_it(window, softcap, tmp_path):
    """Decode rows and a prompt's rows (tiles), each alone, in their batch, and in the batch reversed."""
    torch.manual_seed(1)
    cases = [_case(9, 3, 64, 16, torch.float16, DECODE_LENS, window=window, softcap=softcap),
             _case(9, 3, 64, 16, torch.float16, PROMPT_LENS, shared_table=True, window=window, softcap=softcap)]
    jobs: list[tuple[dict, list[int] | None]] = []
    for c in cases:
        rows = len(c["lens"])
        jobs += [(c, None), (c, list(range(rows - 1, -1, -1)))] + [(c, [r]) for r in range(rows)]
    outs = iter(_on_avx512(jobs, tmp_path))
    for c in cases:
        together, reversed_rows = next(outs), next(outs).flip(0)
        assert torch.equal(together, reversed_rows)
        for r in range(len(c["lens"])):
            assert torch.equal(next(outs)[0], together[r]), f"row {r}"
