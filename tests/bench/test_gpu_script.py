"""The two device scripts in their CPU smoke mode (benchmarks/gpu_bench.sh: model folder, tokenizer,
flags, outputs; benchmarks/gpu_tests.sh: every selected test file still collects), and their shared
part runner: a failed or timed-out part is reported and never stops the parts after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "benchmarks"


def _smoke_env(**extra: str) -> dict[str, str]:
    # A bare SKIP or PYTHON in the caller's environment must change nothing: only prefixed names count.
    return {**os.environ, "STEPAHEAD_GPU_SMOKE": "1", "STEPAHEAD_GPU_PYTHON": sys.executable,
            "SKIP": "compare decode-b4 decode-b8 kernels runner", "PYTHON": "/nonexistent/python", **extra}


def _summary(output: str) -> dict[str, str]:
    """gpu_finish's table: part name -> status."""
    rows = output.split("=== summary\n")[1].split("\n=== ")[0].splitlines()
    return {row.split()[0]: " ".join(row.split()[1:-2]) for row in rows}


def _run(script: str, outdir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPTS / script), str(outdir)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def test_bench_script_smoke_mode_writes_json_trace_and_png(tmp_path):
    env = _smoke_env(STEPAHEAD_GPU_NUM_PROMPTS="4", STEPAHEAD_GPU_MIN_LEN="4", STEPAHEAD_GPU_MAX_LEN="12",
                     STEPAHEAD_GPU_NUM_KV_BLOCKS="64")
    proc = _run("gpu_bench.sh", tmp_path, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (result,) = [p for p in tmp_path.glob("gpu-qwen3-0.6b-dummy-*.json") if not p.name.endswith("-trace.json")]
    data = json.loads(result.read_text())
    assert data["engine_args"]["load_format"] == "dummy" and data["engine_args"]["max_num_batched_tokens"] == 16384
    assert sorted(r["label"] for r in data["runs"]) == ["async", "sync"]
    assert all(r["num_requests"] == 4 and r["output_tokens"] >= 16 for r in data["runs"])
    assert data["runs"][0]["output_tokens"] == data["runs"][1]["output_tokens"]
    trace = json.loads(Path(str(result).replace(".json", "-trace.json")).read_text())
    assert {e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"} == {"engine", "worker"}
    assert Path(str(result).replace(".json", ".png")).read_bytes()[:4] == b"\x89PNG"
    # The decode-step parts: one JSON per shape; and the whole run's log with every part's status.
    decode = {p.name.split("-")[2]: json.loads(p.read_text()) for p in tmp_path.glob("gpu-decode-b*.json")}
    assert sorted(decode) == ["b4", "b8"] and all(d["decode_ms"] for d in decode.values())
    (verify,) = tmp_path.glob("gpu-verify-rows-*.json")  # decode steps of 1 and 5 rows (four drafts verified)
    assert sorted(int(b) for b in json.loads(verify.read_text())["decode_ms"]) == [1, 5]
    (log,) = tmp_path.glob("gpu-bench-2*.log")
    # The bare SKIP set by _smoke_env changed nothing; smoke mode skips transformers by default.
    assert _summary(log.read_text()) == {"compare": "ok", "decode-b4": "ok", "decode-b8": "ok",
                                         "verify-rows": "ok", "transformers": "skipped"}


def test_tests_script_smoke_mode_collects_its_selection(tmp_path):
    # runner and fused skipped: their tests take long interpreted, and skipping is under test too.
    proc = _run("gpu_tests.sh", tmp_path, _smoke_env(STEPAHEAD_GPU_SKIP="runner fused"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (log,) = tmp_path.glob("gpu-tests-2*.log")
    assert _summary(log.read_text()) == {"kernels": "ok", "fused": "skipped", "runner": "skipped",
                                         "memory-sampler": "ok"}
    for part in ("kernels", "memory-sampler"):  # each ran a non-empty selection (the CUDA tests skip here)
        (junit,) = tmp_path.glob(f"gpu-tests-{part}-*.xml")
        assert 'skipped="0"' not in junit.read_text()


def test_failed_and_timed_out_parts_are_reported_and_later_parts_still_run(tmp_path):
    script = f"""
set -euo pipefail
source {SCRIPTS / "gpu_common.sh"}
LOG={tmp_path / "log"}
gpu_part first 5 true
gpu_part broken 5 false
gpu_part stuck 1 sleep 30
gpu_part skipped-one 5 false
gpu_part last 5 touch {tmp_path / "last-ran"}
gpu_finish
"""
    proc = subprocess.run(["bash", "-c", script], env={**os.environ, "STEPAHEAD_GPU_SKIP": "skipped-one"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert (tmp_path / "last-ran").exists()
    assert _summary(proc.stdout) == {"first": "ok", "broken": "FAILED (exit 1)", "stuck": "TIMED OUT", "skipped-one": "skipped",
                       "last": "ok"}
    assert "some parts failed" in proc.stdout
