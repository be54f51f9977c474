#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it has torch, triton, transformers, numpy, matplotlib, tqdm,
# pytest, but no network) into .whl/ (git-ignored), pinned to the versions this repo's venv runs.
# benchmarks/gpu.sh installs them from there into a temporary folder before it starts.
#
#   bash benchmarks/fetch_gpu_wheels.sh            # then carry .whl/ along with the working tree
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
mkdir -p "$REPO/.whl"
PKGS=(fastapi starlette pydantic pydantic_core annotated-types typing-inspection typing_extensions uvicorn
      h11 click anyio sniffio idna pyzmq msgspec gguf xgrammar apache-tvm-ffi)
for pkg in "${PKGS[@]}"; do
  ver="$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$pkg")"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any -d "$REPO/.whl" "$pkg==$ver"
done
ls -la "$REPO/.whl"
