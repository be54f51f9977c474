#!/usr/bin/env bash
# Device script 1 of 2: the CUDA tests on one GPU, in four parts, each bounded by a timeout and run
# whatever the others did (the timeouts add to 500 s, inside one 600 s device command):
#   kernels          the Triton kernels against a float64 reference (bf16/fp32, block sizes 1/16/128,
#                    split-KV decode, a mixed step's decode rows first, a captured graph following new
#                    metadata);
#   fused            the layers' fused kernels (q/k norm + rope, residual add + RMSNorm) against the torch
#                    path, and a runner using them against transformers;
#   runner           greedy ids against transformers in float32 (llama/mistral/qwen2/qwen3, graphs on
#                    and off), bf16 graph replay equal to the same padded pass run eagerly, async equal
#                    to sync outputs, the float32 chunked-prefill runner;
#   memory-sampler   the KV pool sized from GPU memory, the vectorized sampler on the device.
# Each part writes a JUnit XML beside the log; the summary at the end gives every part's status, and
# the script exits nonzero when any failed. Device script 2 is benchmarks/gpu_bench.sh.
#
#   bash benchmarks/gpu_tests.sh [OUTDIR]      # default OUTDIR: benchmarks/results
#
# On the lent GPU machine: give OUTDIR under $OUT (only that comes back) and carry .whl/ along with the
# working tree (git-ignored; benchmarks/fetch_gpu_wheels.sh fills it).
# Environment: STEPAHEAD_GPU_PYTHON (default: the repo's venv if it has CUDA, else python3),
# STEPAHEAD_GPU_SKIP (part names to skip), STEPAHEAD_GPU_SMOKE=1 (the same selection on CPU, where the
# CUDA tests skip and the fused kernels run interpreted: checks the script and that every selected test
# still exists).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
gpu_setup gpu-tests "${1:-}"

# Each part's JUnit XML is added below; -k cuda picks the CUDA tests of a file.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfE --durations=10)
junit() { echo "--junitxml=$OUTDIR/gpu-tests-$1-$STAMP.xml"; }

gpu_part kernels 120 "${PYTEST[@]}" -k cuda "$(junit kernels)" "$REPO/tests/attention/test_triton_paged.py"
gpu_part fused 60 "${PYTEST[@]}" "$(junit fused)" "$REPO/tests/attention/test_triton_fused.py"
gpu_part runner 220 "${PYTEST[@]}" -k cuda "$(junit runner)" "$REPO/tests/worker/test_runner_triton.py" \
  "$REPO/tests/worker/test_runner_misc.py"
gpu_part memory-sampler 100 "${PYTEST[@]}" -k cuda "$(junit memory-sampler)" \
  "$REPO/tests/worker/test_kv_memory.py" "$REPO/tests/worker/test_sampler.py"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
gpu_finish
