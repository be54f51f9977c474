"""Compile every Triton kernel variant the engine can launch, ahead of time, for a GPU that is not here.

A kernel that fails to compile or spills registers on the target only shows on that GPU, and GPU time
comes rarely: this compiles the launches `triton_paged` plans (the same host code that launches them,
so the same constexprs and the same argument specialisations) with Triton's bundled `ptxas` for
sm_90 (H100/H200) on a machine without a GPU, and reports registers and spills per kernel. It fails on
a compile error, a spill, or a decode kernel larger than the footprint its split count assumes.

    python -m stepahead.attention.triton_aot [--full]   # a table of kernels, registers and spills

The layers' fused kernels (attention/triton_fused.py: q/k norm + rope, residual add + RMSNorm) are
compiled too, at each head size's model. Without --full a representative subset (every kernel and launch kind, every dtype, head size and
block size at least once); --full compiles the whole matrix: fp16/bf16/fp32, head sizes 64 and 128,
block sizes 1, 16 and 128, decode with every split count the engine can pick. Triton must not run
interpreted here (TRITON_INTERPRET unset): the kernels have to be real JIT functions. The binding uses
Triton 3.6's JIT internals (create_function_from_signature, JITFunction._pack_args; the dev extra pins
triton==3.6.0): a Triton upgrade must keep them or adapt compile_variant.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from stepahead.attention import triton_fused, triton_paged
from stepahead.attention.triton_kernels import paged_attention_kernel
from stepahead.attention.triton_paged import KernelLaunch

SM90 = GPUTarget("cuda", 90, 32)
# (num_heads, num_kv_heads) and hidden size per head size: Qwen3-0.6B's at 128, SmolLM2-135M's at 64.
HEADS = {128: (16, 8), 64: (9, 3)}
HIDDEN = {128: 1024, 64: 576}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
BLOCK_SIZES = (1, 16, 128)


@dataclass(frozen=True)
class Variant:
    """One kernel variant: what it is for and the launch that selects it."""

    label: str  # e.g. "decode bf16 hd128 bs16 splits4"
    launch: KernelLaunch


@dataclass(frozen=True)
class Compiled:
    label: str
    kernel: str
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    shared_bytes: int
    seconds: float


def _batch(dtype: torch.dtype, head_dim: int, block_size: int, rows: int, tokens_per_row: int):
    """CPU tensors laid out as the runner's step: q/k/v views of one fused projection, int64 metadata
    (the staging buffer's dtype), a cache of a few blocks. Only shapes, strides and dtypes matter here."""
    num_heads, num_kv_heads = HEADS[head_dim]
    tokens = rows * tokens_per_row
    fused = torch.empty(tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype)
    q, k, v = fused.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    cache_shape = (num_kv_heads, 64, block_size, head_dim)
    meta = dict(block_table=torch.zeros(rows, 8, dtype=torch.int64),
                seq_lens=torch.zeros(rows, dtype=torch.int64),
                query_start_loc=torch.arange(rows + 1, dtype=torch.int64) * tokens_per_row)
    return q, k, v, torch.empty(cache_shape, dtype=dtype), torch.empty(cache_shape, dtype=dtype), meta


def variants(full: bool) -> Iterator[Variant]:
    """The launches to compile: the whole matrix, or a subset that still covers every kernel and kind."""
    for dtype_name, dtype in DTYPES.items():
        for head_dim in HEADS:
            for block_size in BLOCK_SIZES:
                base = f"{dtype_name} hd{head_dim} bs{block_size}"
                # The subset: bf16 at head size 128 with every block size, and one block size of each
                # other dtype and head size.
                core = (dtype_name == "bf16" and head_dim == 128) or block_size == 16 and \
                    (dtype_name == "bf16" or head_dim == 128)
                if not full and not core:
                    continue
                q, k, v, k_cache, v_cache, meta = _batch(dtype, head_dim, block_size, 4, 1)
                slots = torch.zeros(q.shape[0], dtype=torch.int64)
                launch = triton_paged.write_kv_launch(k, v, k_cache, v_cache, slots)
                assert launch is not None  # the batch has tokens
                yield Variant(f"write_kv {base}", launch)
                every_split = full or (dtype_name, head_dim, block_size) == ("bf16", 128, 16)
                splits = triton_paged.KV_SPLIT_CHOICES if every_split else (1,)
                for num_splits in splits:
                    out = torch.empty(q.shape, dtype=dtype)
                    launches = triton_paged.attention_launches(
                        q, k_cache, v_cache, max_query_len=1, scale=1.0, out=out, num_kv_splits=num_splits, **meta)
                    yield Variant(f"decode {base} splits{num_splits}", launches[0])
                    # The merge does not depend on the block size: once per dtype and head size.
                    if len(launches) > 1 and (block_size == BLOCK_SIZES[0] or not full):
                        yield Variant(f"merge {dtype_name} hd{head_dim} splits{num_splits}", launches[1])
                q, k, v, k_cache, v_cache, meta = _batch(dtype, head_dim, block_size, 2, 40)
                out = torch.empty(q.shape, dtype=dtype)
                (launch,) = triton_paged.attention_launches(q, k_cache, v_cache, max_query_len=40, scale=1.0,
                                                           out=out, **meta)
                yield Variant(f"prefill {base}", launch)
                if full or (dtype_name, head_dim, block_size) == ("bf16", 128, 16):
                    # Gemma's layers: a sliding window and soft-capped logits (other constexprs)
                    (launch,) = triton_paged.attention_launches(q, k_cache, v_cache, max_query_len=40, scale=1.0,
                                                               out=out, window=32, softcap=50.0, **meta)
                    yield Variant(f"prefill window softcap {base}", launch)
                    q, k, v, k_cache, v_cache, meta = _batch(dtype, head_dim, block_size, 4, 1)
                    out = torch.empty(q.shape, dtype=dtype)
                    launches = triton_paged.attention_launches(q, k_cache, v_cache, max_query_len=1, scale=1.0,
                                                               out=out, num_kv_splits=2, window=32, softcap=50.0,
                                                               **meta)
                    yield Variant(f"decode window softcap {base} splits2", launches[0])
            if full or dtype_name == "bf16":
                yield from _fused_variants(dtype_name, dtype, head_dim)


def _fused_variants(dtype_name: str, dtype: torch.dtype, head_dim: int) -> Iterator[Variant]:
    """The layers' fused kernels (attention/triton_fused.py) at the model whose head size this is."""
    num_heads, num_kv_heads = HEADS[head_dim]
    hidden = HIDDEN[head_dim]
    fused = torch.empty(4, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype)
    qk, cos_sin, weight = fused[:, :num_heads + num_kv_heads], torch.empty(4, 2, head_dim, dtype=dtype), \
        torch.empty(head_dim, dtype=dtype)
    base = f"{dtype_name} hd{head_dim}"
    yield Variant(f"rope {base}", triton_fused.rope_qk_norm_launch(qk, cos_sin, num_heads))
    yield Variant(f"qk_norm_rope {base}", triton_fused.rope_qk_norm_launch(qk, cos_sin, num_heads, weight, weight))
    x = torch.empty(4, hidden, dtype=dtype)
    yield Variant(f"add_rms_norm {dtype_name} hidden{hidden}",
                  triton_fused.add_rms_norm_launch(x, x, torch.empty(hidden, dtype=dtype), 1e-6, x, x))


_PTXAS_USAGE = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_variant(variant: Variant, target: GPUTarget = SM90) -> Compiled:
    """Compile one launch for `target` the way the JIT would on that GPU; registers and spills from ptxas."""
    launch = variant.launch
    kernel = launch.kernel
    if not isinstance(kernel, triton.runtime.JITFunction):
        raise RuntimeError("Triton runs interpreted (TRITON_INTERPRET=1): nothing to compile")
    backend = make_backend(target)
    # The JIT's own argument binding: the same specialisations (ints equal to 1 or divisible by 16,
    # 16-byte aligned pointers) and options a launch of these arguments would compile with.
    kwargs = dict(launch.kwargs, debug=False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    log = io.StringIO()
    started = time.monotonic()
    with triton.knobs.nvidia.scope(), triton.knobs.cache.scope(), contextlib.redirect_stdout(log):
        triton.knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas -v's report: registers, spills
        triton.knobs.cache.dir = _fresh_cache_dir()  # a cached binary would skip ptxas and its report
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    seconds = time.monotonic() - started
    report = log.getvalue()
    usage, spills = _PTXAS_USAGE.search(report), _PTXAS_SPILLS.search(report)
    if usage is None or spills is None:
        raise RuntimeError(f"{variant.label}: no ptxas report in {report!r}")
    return Compiled(variant.label, kernel.__name__, int(usage.group(1)), int(spills.group(1)),
                    int(spills.group(2)), compiled.metadata.shared, seconds)


_cache_root: str | None = None


def _fresh_cache_dir() -> str:
    global _cache_root
    if _cache_root is None:
        _cache_root = tempfile.mkdtemp(prefix="stepahead-aot-")
        atexit.register(shutil.rmtree, _cache_root, True)
    return tempfile.mkdtemp(dir=_cache_root)


def over_footprint(variant: Variant, result: Compiled) -> bool:
    """A decode variant that needs more registers or shared memory than the split-count estimate assumes
    (triton_paged.DECODE_FOOTPRINTS): the estimate is stale and would put too many blocks on an SM."""
    kw = variant.launch.kwargs
    if variant.launch.kernel is not paged_attention_kernel or not kw["DECODE"]:
        return False
    q = variant.launch.args[0]
    footprint = triton_paged.decode_footprint(q.dtype == torch.float32, kw["BLOCK_D"], kw["num_warps"])
    return result.registers > footprint.registers or result.shared_bytes > footprint.shared_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="every variant, not the representative subset")
    ns = parser.parse_args(argv)
    failures = 0
    print(f"{'variant':40} {'regs':>5} {'spill st/ld':>12} {'smem KB':>8} {'s':>5}")
    for variant in variants(ns.full):
        result = compile_variant(variant)
        problems = (["SPILLS"] if result.spill_stores or result.spill_loads else []) + \
            (["OVER DECODE_FOOTPRINTS"] if over_footprint(variant, result) else [])
        failures += bool(problems)
        print(f"{result.label:40} {result.registers:5d} {result.spill_stores:6d}/{result.spill_loads:<5d}"
              f" {result.shared_bytes / 1024:8.1f} {result.seconds:5.1f}" + "".join(f"  {p}" for p in problems))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
