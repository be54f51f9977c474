"""benchmarks/gpu.sh in its CPU smoke mode: the script (model folder, tokenizer, flags) keeps working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_script_smoke_mode_writes_json_trace_and_png(tmp_path):
    env = {**os.environ, "SMOKE": "1", "PYTHON": sys.executable, "NUM_PROMPTS": "4", "MIN_LEN": "4",
           "MAX_LEN": "12", "NUM_KV_BLOCKS": "64"}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh"), str(tmp_path)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
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
    # The decode-step part: one JSON per shape; and the whole run's log.
    decode = {p.name.split("-")[2]: json.loads(p.read_text()) for p in tmp_path.glob("gpu-decode-b*.json")}
    assert sorted(decode) == ["b4", "b8"] and all(d["decode_ms"] for d in decode.values())
    (log,) = tmp_path.glob("gpu-2*.log")
    assert "=== 3. ms per decode step" in log.read_text()
