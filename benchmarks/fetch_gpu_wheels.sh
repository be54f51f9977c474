#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it has torch, triton, transformers, numpy, matplotlib, tqdm,
# pytest, but no network) into .whl/ (git-ignored), pinned to the versions this repo's venv runs.
# The device scripts (benchmarks/gpu_tests.sh, benchmarks/gpu_bench.sh) install them from there into a
# temporary folder before they start (benchmarks/gpu_common.sh).
#
#   bash benchmarks/fetch_gpu_wheels.sh            # then carry .whl/ along with the working tree
# STEPAHEAD_GPU_LOCAL_PYTHON: the python whose package versions are pinned (default: the repo's venv).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${STEPAHEAD_GPU_LOCAL_PYTHON:-$REPO/.venv/bin/python}"
mkdir -p "$REPO/.whl"
PKGS=(fastapi opentelemetry-api annotated-doc starlette pydantic pydantic_core annotated-types typing-inspection typing_extensions uvicorn
      h11 click anyio sniffio idna pyzmq msgspec gguf xgrammar apache-tvm-ffi)
for pkg in "${PKGS[@]}"; do
  ver="$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$pkg")"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any -d "$REPO/.whl" "$pkg==$ver"
done
ls -la "$REPO/.whl"
