"""benchmarks/soak.py, briefly, on the tiny model: mixed load and bad bodies leave no 5xx, no invalid
constrained output, no traceback, and a drained engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_short_soak_passes(tiny_llama, tmp_path):
    result_path = tmp_path / "soak.json"
    # Memory is not judged in a run this short (the KV pool's pages are still being touched).
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "soak.py"), str(tiny_llama), "--duration", "5",
                           "--clients", "4", "--num-kv-blocks", "0", "--max-rss-growth", "10",
                           "--json", str(result_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    result = json.loads(result_path.read_text())
    assert proc.returncode == 0 and result["passed"], proc.stdout + proc.stderr
    assert set(result["kinds"]) == {"plain", "stream", "json", "choice", "regex", "disconnect", "timeout", "bad"}, \
        result["kinds"]
    assert result["statuses"].get("400", 0) == result["kinds"]["bad"]
