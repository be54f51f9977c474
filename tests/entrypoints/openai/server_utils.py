"""A real `stepahead serve` subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
STARTUP_TIMEOUT_S = 180  # a generous bound for a shared 2-core machine; not a performance check
_PORT_RE = re.compile(r"serving on http://[^:]+:(\d+)")


class RemoteServer:
    """`python -m stepahead.entrypoints.openai.api_server MODEL --port 0 ...`; the bound port is read from its log."""

    def __init__(self, model: str | Path, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "stepahead.entrypoints.openai.api_server", str(model),
               "--host", "127.0.0.1", "--port", "0", *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []
        self._port_found = threading.Event()
        self.port: int | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._wait_healthy()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = _PORT_RE.search(line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._port_found.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited during startup ({self.proc.returncode}):\n{self.log}")
            if self._port_found.is_set():
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log}")

    def process_tree(self) -> list[int]:
        """The server and every descendant (engine process, worker, multiprocessing helpers)."""
        return [self.proc.pid, *descendants(self.proc.pid)]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        return self.proc.returncode


def children(pid: int) -> list[int]:
    try:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    except OSError:
        return []
    return [int(x) for x in out.split()]


def descendants(pid: int) -> list[int]:
    out = []
    for c in children(pid):
        out.append(c)
        out.extend(descendants(c))
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _spawned(pids: list[int]) -> list[int]:
    """The multiprocessing-spawned processes among pids, resource trackers left out."""
    return [pid for pid in pids if "spawn_main" in (line := cmdline(pid)) and "resource_tracker" not in line]


def engine_pid(server: RemoteServer) -> int:
    """The engine-core process: the server's spawned child."""
    for pid in _spawned(children(server.proc.pid)):
        return pid
    raise AssertionError(f"no engine process under server {server.proc.pid}")


def worker_pid(server: RemoteServer) -> int:
    """The model worker: the spawned grandchild (engine process -> worker), not a resource tracker."""
    for engine in children(server.proc.pid):
        for pid in _spawned(children(engine)):
            return pid
    raise AssertionError(f"no worker process under server {server.proc.pid}")


def wait_until(pred, timeout: float = 60.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (and bare names for unlabelled samples)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out


def metric(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total, found = 0.0, False
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
            found = True
    if not found:
        raise KeyError(f"{name} {labels} not in metrics")
    return total
