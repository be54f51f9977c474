# Shared by the two device scripts (benchmarks/gpu_tests.sh, benchmarks/gpu_bench.sh); sourced, not run.
#
# gpu_setup NAME OUTDIR  picks the python, tees everything into OUTDIR/NAME-<stamp>.log, installs the
#                        wheels the GPU machine lacks and checks the imports; sets REPO, OUTDIR, PY, STAMP,
#                        SMOKE, DEVICE.
# gpu_part NAME SECONDS CMD...  runs one part under `timeout` and records how it ended; a failed part
#                        never stops the ones after it.
# gpu_finish             prints every part's status and exits nonzero when any part failed or timed out.
#
# Every variable a user may set starts with STEPAHEAD_GPU_ (a generic SKIP or PYTHON in someone's shell
# must not change what runs): STEPAHEAD_GPU_PYTHON, STEPAHEAD_GPU_SMOKE=1 (CPU check of the script),
# STEPAHEAD_GPU_SKIP (space-separated part names); each script documents its own.

GPU_PARTS=()     # "name|status|seconds", in run order
GPU_FAILED=0

gpu_wants() { [[ " ${STEPAHEAD_GPU_SKIP:-} " != *" $1 "* ]]; }

gpu_part() {
  local name="$1" limit="$2"
  shift 2
  if ! gpu_wants "$name"; then
    GPU_PARTS+=("$name|skipped|0")
    return 0
  fi
  echo
  echo "=== $name (limit ${limit} s, $(date -u +%H:%M:%S))"
  local started=$SECONDS rc=0
  # -k: a part that ignores SIGTERM (a stuck worker process) is killed 10 s later.
  timeout -k 10 "$limit" "$@" || rc=$?
  local took=$(( SECONDS - started )) status=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status="TIMED OUT"
  elif [ "$rc" -ne 0 ]; then
    status="FAILED (exit $rc)"
  fi
  [ "$status" = ok ] || GPU_FAILED=1
  echo "=== $name: $status after ${took} s"
  GPU_PARTS+=("$name|$status|$took")
}

gpu_finish() {
  echo
  echo "=== summary"
  local entry name status took
  for entry in "${GPU_PARTS[@]}"; do
    IFS='|' read -r name status took <<<"$entry"
    printf '  %-24s %-20s %5s s\n' "$name" "$status" "$took"
  done
  if [ "$GPU_FAILED" -ne 0 ]; then
    echo "=== some parts failed; their output is above and in $LOG"
    return 1
  fi
  echo "=== all parts passed; log in $LOG"
}

gpu_setup() {
  local name="$1"
  REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  OUTDIR="${2:-$REPO/benchmarks/results}"
  mkdir -p "$OUTDIR"
  OUTDIR="$(cd "$OUTDIR" && pwd)"
  SMOKE="${STEPAHEAD_GPU_SMOKE:-0}"
  DEVICE=cuda
  [ "$SMOKE" = 1 ] && DEVICE=cpu
  # The repo's venv when it has a CUDA torch (or in smoke mode); else the machine's python3.
  PY="${STEPAHEAD_GPU_PYTHON:-}"
  if [ -z "$PY" ]; then
    PY=python3
    if [ -x "$REPO/.venv/bin/python" ] && \
       "$REPO/.venv/bin/python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() or sys.argv[1] == "1" else 1)' \
         "$SMOKE" 2>/dev/null; then
      PY="$REPO/.venv/bin/python"
    fi
  fi
  STAMP="$(date -u +%Y%m%d-%H%M%S)"
  LOG="$OUTDIR/$name-$STAMP.log"
  exec > >(tee -a "$LOG") 2>&1   # everything below is also in the log
  # Packages the GPU machine lacks, shipped as wheels (benchmarks/fetch_gpu_wheels.sh); run from the tree.
  local site=""
  if ! "$PY" -c "import fastapi, pydantic, uvicorn, zmq, msgspec, gguf" 2>/dev/null \
     && ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
    site=/tmp/stepahead-site
    "$PY" -m pip install -q --no-index --no-deps --target "$site" "$REPO"/.whl/*.whl
  fi
  export PYTHONPATH="$REPO${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
  "$PY" - "$name" "$SMOKE" <<'EOF'
import importlib.util, sys
name, smoke = sys.argv[1], sys.argv[2] == "1"
missing = [m for m in ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "matplotlib",
                       "tqdm", "pytest", "fastapi", "pydantic", "zmq", "msgspec", "gguf")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"{name}: python lacks {missing} (benchmarks/fetch_gpu_wheels.sh ships what the GPU machine lacks)")
import torch
if not smoke and not torch.cuda.is_available():
    sys.exit(f"{name}: no CUDA device visible to torch (STEPAHEAD_GPU_SMOKE=1 runs a small CPU check instead)")
print(f"{name}: python {sys.version.split()[0]}, torch {torch.__version__}",
      f"on {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "on CPU")
EOF
}
