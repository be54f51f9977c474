"""Servers of their own: API key, worker or engine death (mid-stream and idle), shutdown with no orphan processes."""

from __future__ import annotations

import glob
import json
import os
import signal
import tempfile
import threading
import time

import httpx
import openai
import pytest

from stepahead.entrypoints.openai.api_server import resolve_api_key
from stepahead.entrypoints.openai.server_args import make_parser
from tests.entrypoints.openai.conftest import MODEL_NAME, SERVER_ARGS
from tests.entrypoints.openai.server_utils import (
    RemoteServer,
    alive,
    engine_pid,
    metric,
    parse_metrics,
    wait_until,
    worker_pid,
)

LONG = {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": 480, "ignore_eos": True, "stream": True}


def _stream_events(url: str, body: dict, on_event=None, headers=None) -> list[str]:
    """All SSE data payloads of one streaming request; on_event(i) is called after the i-th event."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120, headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if on_event is not None:
                    on_event(len(events))
    return events


def _no_orphans(pids: list[int]) -> bool:
    return not any(alive(p) for p in pids)


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None  # the server is gone


def test_api_key_env_var():
    ns = make_parser().parse_args([])
    assert resolve_api_key(ns, {"STEPAHEAD_API_KEY": "from-env"}) == "from-env"
    ns = make_parser().parse_args(["--api-key", "from-flag"])
    assert resolve_api_key(ns, {"STEPAHEAD_API_KEY": "from-env"}) == "from-flag"
    assert resolve_api_key(make_parser().parse_args([]), {}) is None


def test_api_key_then_sigint_shutdown(tiny_llama):
    srv = RemoteServer(tiny_llama, *SERVER_ARGS, "--api-key", "flag-key-123")
    try:
        assert "flag-key-123" not in srv.log and "**REDACTED**" in srv.log
        headers = {"Authorization": "Bearer flag-key-123"}
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer flag-key-12"})
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(srv.url + path).status_code == 200, path
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=srv.base_url, api_key="flag-key-123", max_retries=0)
        assert ok.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).usage.completion_tokens == 2
        pids = srv.process_tree()
        # SIGINT (Ctrl-C) with a stream in flight and --shutdown-timeout 0: the stream is aborted with
        # an error event, the server exits 0, no process is left.
        started = threading.Event()
        result: dict = {}

        def client():
            result["events"] = _stream_events(srv.url, LONG, lambda i: i == 2 and started.set(), headers)

        t = threading.Thread(target=client)
        t.start()
        assert started.wait(120)
        assert srv.stop(signal.SIGINT) == 0
        t.join(60)
        events = result["events"]
        assert events[-1] == "[DONE]"
        assert "shutting down" in json.loads(events[-2])["error"]["message"]
        assert wait_until(lambda: _no_orphans(pids), timeout=30), [p for p in pids if alive(p)]
    finally:
        srv.stop()


def test_worker_death_mid_stream(tiny_llama):
    srv = RemoteServer(tiny_llama, *SERVER_ARGS)
    try:
        pids = srv.process_tree()
        worker = worker_pid(srv)
        killed = threading.Event()

        def kill_worker(i: int) -> None:
            if i == 3 and not killed.is_set():
                os.kill(worker, signal.SIGKILL)
                killed.set()

        events = _stream_events(srv.url, LONG, kill_worker)
        assert killed.is_set()
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        # The request in flight learns the cause, not only the requests that come later.
        assert err["code"] == 500 and f"pid {worker}" in err["message"] and "signal 9" in err["message"], err
        assert httpx.get(srv.url + "/health").status_code == 503
        # New work is refused with a 500, not a hang.
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 500 and "dead" in r.json()["error"]["message"]
        assert srv.proc.wait(timeout=60) == 1
        assert "The engine is dead" in srv.log
        assert wait_until(lambda: _no_orphans(pids), timeout=30), [p for p in pids if alive(p)]
    finally:
        srv.stop()


def test_sigterm_drains_in_flight_requests(tiny_llama, tmp_path):
    trace = tmp_path / "trace.json"
    srv = RemoteServer(tiny_llama, *SERVER_ARGS, "--shutdown-timeout", "120", "--trace", str(trace))
    try:
        pids = srv.process_tree()
        started = threading.Event()
        result: dict = {}
        body = {**LONG, "max_tokens": 60}

        def client():
            result["events"] = _stream_events(srv.url, body, lambda i: i == 2 and started.set())

        t = threading.Thread(target=client)
        t.start()
        assert started.wait(120)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(120)
        events = result["events"]
        # Drained: the request ran to its end despite the SIGTERM.
        assert events[-1] == "[DONE]"
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finish[-1] == "length" and "error" not in events[-2]
        assert srv.proc.wait(timeout=60) == 0
        assert wait_until(lambda: _no_orphans(pids), timeout=30), [p for p in pids if alive(p)]
        # --trace FILE: the engine and worker timelines of the whole run, as a Chrome trace.
        names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
        assert {"schedule", "update_from_output"} <= names
    finally:
        srv.stop()


@pytest.mark.parametrize("victim,extra_args", [("worker", ()), ("engine", ()),
                                                ("rank", ("--pipeline-parallel-size", "2"))])
def test_process_death_while_idle(tiny_llama, victim, extra_args):
    """A worker (or one of two pipeline ranks) or the engine process killed while no request runs:
    /health is 503 within 5 s, the server exits 1."""
    srv = RemoteServer(tiny_llama, *SERVER_ARGS, *extra_args)
    try:
        pids = srv.process_tree()
        os.kill(engine_pid(srv) if victim == "engine" else worker_pid(srv), signal.SIGKILL)
        killed = time.monotonic()
        assert wait_until(lambda: _health(srv.url) == 503, timeout=5, interval=0.05), srv.log
        print(f"/health 503 {time.monotonic() - killed:.2f} s after killing the {victim}")
        assert srv.proc.wait(timeout=30) == 1
        assert "The engine is dead" in srv.log
        assert wait_until(lambda: _no_orphans(pids), timeout=30), [p for p in pids if alive(p)]
    finally:
        srv.stop()



@pytest.mark.parametrize("shutdown_args, num_posts", [(("--shutdown-timeout", "0"), 3),
                                                      (("--shutdown-timeout", "1", "--max-num-seqs", "1"), 12)],
                         ids=["cut", "deadline"])
def test_sigterm_cuts_in_flight_requests_with_503(tiny_llama, shutdown_args, num_posts):
    """--shutdown-timeout 0 (cut at once) or a drain whose deadline passes (one request runs at a time, and
    twelve long ones take seconds, so some still run or wait then): cut requests get a clean 503 (streams
    an error event), the others finish, and no traceback is logged."""
    srv = RemoteServer(tiny_llama, *SERVER_ARGS, *shutdown_args)
    draining = shutdown_args[1] != "0"
    try:
        body = {**LONG, "stream": False}
        replies: list[httpx.Response] = []
        streamed: dict = {}

        def post() -> None:
            replies.append(httpx.post(srv.url + "/v1/completions", json=body, timeout=120))

        def stream() -> None:
            streamed["events"] = _stream_events(srv.url, LONG)

        threads = [threading.Thread(target=post) for _ in range(num_posts)] + [threading.Thread(target=stream)]
        for t in threads:
            t.start()

        def all_admitted() -> bool:
            metrics = parse_metrics(httpx.get(srv.url + "/metrics").text)
            return (metric(metrics, "stepahead:num_requests_running")
                    + metric(metrics, "stepahead:num_requests_waiting")) == num_posts + 1

        assert wait_until(all_admitted, timeout=120)
        assert srv.stop(signal.SIGTERM) == 0
        for t in threads:
            t.join(60)
        assert len(replies) == num_posts
        events = streamed["events"]
        assert events[-1] == "[DONE]"
        cut = [r for r in replies if r.status_code != 200]
        stream_cut = "error" in json.loads(events[-2])
        if draining:  # the drain let some finish, and its deadline cut the rest
            assert cut or stream_cut, [r.status_code for r in replies]
        else:  # nothing finishes
            assert len(cut) == num_posts and stream_cut, [r.status_code for r in replies]
        for r in cut:
            assert r.status_code == 503, r.text
            assert r.json() == {"error": {"message": "The server is shutting down", "type": "ServiceUnavailableError",
                                          "param": None, "code": 503}}
        if stream_cut:
            assert json.loads(events[-2])["error"]["code"] == 503
        assert "Traceback" not in srv.log and "Internal server error" not in srv.log, srv.log
        assert "Streaming request failed" not in srv.log  # one shutdown line in total, not one per request
    finally:
        srv.stop()


def test_no_socket_files_outlive_startup(tiny_llama):
    """The engine's socket files are removed once both connections are made: a server killed with
    SIGKILL (no exit path of its own runs) leaves nothing in the temporary directory."""
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "stepahead-ipc-*")))
    srv = RemoteServer(tiny_llama, *SERVER_ARGS)
    try:
        pids = srv.process_tree()
        assert set(glob.glob(os.path.join(tempfile.gettempdir(), "stepahead-ipc-*"))) <= before
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text  # the connections work without the files
        srv.stop(signal.SIGKILL)
        assert wait_until(lambda: _no_orphans(pids), timeout=30), [p for p in pids if alive(p)]
        assert set(glob.glob(os.path.join(tempfile.gettempdir(), "stepahead-ipc-*"))) <= before
    finally:
        srv.stop()
