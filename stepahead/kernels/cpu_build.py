"""stepahead's CPU kernels (the .cpp files beside this one), compiled into one extension with torch's
C++ extension builder on first use: once per machine (it takes a while), then loaded from torch's cache
(~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR).

They need an x86 CPU with AVX2 (and FMA and F16C, which every AVX2 CPU has) and a C++ compiler; where
either is missing, or the build fails, `available()` is False (logged once) and every caller keeps
torch's own operators. Setting STEPAHEAD_DISABLE_CPU_KERNELS=1 does the same on purpose (A/B runs,
debugging)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name)
           for name in ("bindings.cpp", "packed_gemm.cpp", "rms_norm.cpp", "rope.cpp", "paged_decode.cpp",
                         "paged_decode_avx512.cpp", "silu_mul.cpp", "decode_stack.cpp", "round_bf16.cpp",
                         "kv_store.cpp", "packed_gemm_zmm.cpp", "amx_gemm.cpp",
                         "suffix_trie.cpp")]
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# -fopenmp: at::parallel_for is inlined into the kernels; -ffp-contract=off: a multiply and an add stay
# two roundings unless a kernel asks for a fused multiply-add (rope.cpp matches torch's arithmetic so).
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]
DISABLE_ENV = "STEPAHEAD_DISABLE_CPU_KERNELS"


def available() -> bool:
    """Whether the kernels are built and loaded in this process."""
    return _module() is not None


@functools.cache
def _module():
    """The extension module (bindings.cpp), or None where it is switched off or cannot be built."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    if not machine_can_build():
        logger.info("stepahead's CPU kernels not used: they need an AVX2 CPU and a C++ compiler")
        return None
    try:
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        return cpp_extension.load(name=extension_name(), sources=[str(s) for s in SOURCES],
                                  extra_cflags=FLAGS, verbose=False)
    except Exception as exc:  # no compiler, no ninja, no headers: torch's operators still work
        logger.warning("stepahead's CPU kernels not built (%s: %s); using torch's operators", type(exc).__name__, exc)
        return None


def extension_name() -> str:
    """The module's name, with a digest of every source and header: torch's builder rebuilds on a change
    of the sources it compiles but not of the headers they include, and two checkouts with different
    kernels must not take turns overwriting one cached build."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"stepahead_cpu_kernels_{digest.hexdigest()[:12]}"


def machine_can_build() -> bool:
    """An AVX2 CPU and a C++ compiler: where both exist, the kernels are expected to build."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and shutil.which("c++") is not None


def op(name: str):
    """The kernel `name` (a function of the extension module: callers look it up once)."""
    module = _module()
    if module is None:
        raise RuntimeError("stepahead's CPU kernels are not built on this machine (see the log)")
    return getattr(module, name)


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the ninja wheel installs it beside the interpreter, which
    is not on PATH when a virtual environment's python is run directly."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
