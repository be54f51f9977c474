"""The AVX2 4-bit GEMM (int4_gemm.cpp), compiled with torch's C++ extension builder on first use.

torch's own weight-only int4 kernel multiplies bf16 activations with weights dequantized in floating
point; this one keeps GGUF's block layout, quantizes the activations to 16-bit integers per group of
32 and multiplies with exact integer dot products (llama.cpp's Q4 x Q8 scheme with twice the activation
bits). Over the built-in model's 120 projections at 32 rows it took 115-130 ms against 161-194 ms
(three runs); at one row it is within the noise of torch's (14-21 against 18-19 ms). Its logits are
closer to the fp32 model's (fp32 scales instead of bf16 ones). A row's result does not depend on its batch (see the source). It needs an x86 CPU with
AVX2 and FMA and a C++ compiler; where either is missing, or the build fails, `available()` is False
(logged once) and the packed linears use torch's kernel."""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int4_gemm.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]  # -fopenmp: at::parallel_for is inlined into the kernel
GROUP = 32  # inputs per scale and offset, GGUF's block
DISABLE_ENV = "STEPAHEAD_DISABLE_CPU_KERNELS"  # set to 1 to use torch's kernels (A/B runs, debugging)


@functools.cache
def available() -> bool:
    """Whether the kernel is built and loaded in this process (built once per machine, then cached)."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return False
    if not machine_can_build():
        logger.info("CPU int4 kernel not used: it needs an AVX2 CPU and a C++ compiler")
        return False
    try:
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        cpp_extension.load(name="stepahead_cpu_int4", sources=[str(SOURCE)], extra_cflags=FLAGS,
                           is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, no headers: torch's kernel still works
        logger.warning("CPU int4 kernel not built (%s: %s); using torch's int4 kernel", type(exc).__name__, exc)
        return False
    return True


def machine_can_build() -> bool:
    """An AVX2 CPU and a C++ compiler: where both exist, the kernel is expected to build."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and shutil.which("c++") is not None


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the ninja wheel installs it beside the interpreter, which
    is not on PATH when a virtual environment's python is run directly."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def int4_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 times the [N, K] weight  codes * scales + mins  (GGUF block layout): [M, N] float32,
    with x and the result rounded to bf16 values."""
    return _op()(x, codes, scales, mins)


@functools.cache
def _op():
    """The loaded operator, looked up once (a projection calls it every step)."""
    if not available():
        raise RuntimeError("stepahead's CPU int4 kernel is not built on this machine (see the log)")
    return torch.ops.stepahead_cpu.int4_gemm.default


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 in GGUF's block layout: [N, K / 2] bytes, byte j of a group of 32 holding
    element j in its low nibble and element j + 16 in its high nibble."""
    groups = q.to(torch.uint8).view(q.shape[0], -1, GROUP)
    return (groups[..., : GROUP // 2] | (groups[..., GROUP // 2 :] << 4)).reshape(q.shape[0], -1).contiguous()


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """pack_codes undone: [N, K] uint8 codes."""
    halves = codes.view(codes.shape[0], -1, GROUP // 2)
    return torch.cat((halves & 0x0F, halves >> 4), dim=-1).reshape(codes.shape[0], -1)
