"""A bounded schemathesis run against the real server: generated requests from its own OpenAPI schema
(a bounded fuzzing phase; the coverage phase adds ~1,100 cases and a minute) get no server error, only documented status codes and content types."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

SCHEMATHESIS = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")


def test_generated_requests_get_no_server_error_and_only_documented_answers(server, tmp_path):
    proc = subprocess.run(
        [SCHEMATHESIS, "run", server.url + "/openapi.json",
         "--checks", "not_a_server_error,status_code_conformance,content_type_conformance",
         "--phases", "fuzzing", "-n", "25", "--seed", "1", "--request-timeout", "60"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)  # its run cache lands there
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert "generated" in proc.stdout
