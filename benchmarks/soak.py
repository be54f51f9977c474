"""A soak of `stepahead serve` under mixed load and bad input: nothing may take the server down.

For DURATION seconds, CLIENTS threads send a random mix: plain and streamed completions, chat under a
JSON schema, a choice and a regex, streams the client drops after a few events, requests the client
times out, and bad bodies (malformed JSON, out-of-range fields, schemas nested past the limit, huge
stop lists). Checked, and printed as one JSON line at the end:

- no 5xx at all; every bad body a 4xx with an OpenAI-shaped error;
- every 200 body well formed, and every constrained output that finished with "stop" valid (the
  schema validates, the choice is one of the choices, the regex matches);
- after the load, no request running or waiting and the KV cache back to 0 within a few seconds;
- the server's resident memory (its process tree's) at half time (after warm-up) and at the end:
  growth at most --max-rss-growth.

    .venv/bin/python benchmarks/soak.py                      # built-in model, 60 s, 20 clients
    .venv/bin/python benchmarks/soak.py MODEL --duration 120 --clients 20 --num-kv-blocks 64

Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import jsonschema

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.entrypoints.openai.server_utils import RemoteServer, descendants, parse_metrics  # noqa: E402

# The name's length is bounded by a pattern, not maxLength: xgrammar 0.2.9 compiles a maxLength string to a
# rule that admits raw control characters, which JSON forbids (a random model writes them now and then).
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CHOICES = ["yes", "no", "maybe"]
REGEX = r"[a-z]{2,6} [0-9]{1,3}"


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


BAD_BODIES = [
    b'{"prompt": "x", "max_tokens": ',  # malformed JSON
    json.dumps({"prompt": "x", "temperature": -1}).encode(),
    json.dumps({"prompt": "x", "max_tokens": 0}).encode(),
    json.dumps({"prompt": "x", "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "d", "schema": nested(300)}}}).encode(),
    json.dumps({"prompt": "x", "stop": ["s" * 1000] * 200 + [""]}).encode(),
    json.dumps({"prompt": "x", "guided_regex": "(unclosed"}).encode(),
]


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, kind: str, status: int | str, problem: str | None = None) -> None:
        with self.lock:
            self.kinds[kind] += 1
            self.statuses[str(status)] += 1
            if problem is not None and len(self.problems) < 50:
                self.problems.append(f"{kind}: {problem}")


def _text(body: dict) -> tuple[str, str]:
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice["finish_reason"]


def _constrained(client: httpx.Client, kind: str) -> tuple[int, str | None]:
    messages = [{"role": "user", "content": "Give a name and an age as JSON."}]
    body: dict = {"messages": messages, "max_tokens": 48, "temperature": random.choice([0.0, 0.8])}
    if kind == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    elif kind == "choice":
        body["guided_choice"] = CHOICES
    else:
        body["guided_regex"] = REGEX
    r = client.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        return r.status_code, None
    text, finish = _text(r.json())
    if finish != "stop":
        return 200, None
    try:
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "choice" and text not in CHOICES or kind == "regex" and not re.fullmatch(REGEX, text):
            return 200, f"invalid constrained output {text!r}"
    except (ValueError, jsonschema.ValidationError) as e:
        return 200, f"invalid JSON output {text!r}: {e}"
    return 200, None


def _one(client: httpx.Client, tally: Tally) -> None:
    kind = random.choice(["plain", "stream", "json", "choice", "regex", "disconnect", "timeout", "bad"])
    try:
        if kind == "plain":
            r = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 24,
                                                     "temperature": random.choice([0.0, 1.0]), "seed": 3})
            problem = None if r.status_code != 200 else (None if isinstance(_text(r.json())[0], str) else "no text")
            tally.record(kind, r.status_code, problem)
        elif kind in ("stream", "disconnect"):
            body = {"prompt": "The history of", "max_tokens": 40, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as r:
                events = 0
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        json.loads(line[6:])  # every event is JSON
                        events += 1
                        if kind == "disconnect" and events == 3:
                            break
                tally.record(kind, r.status_code)
        elif kind in ("json", "choice", "regex"):
            status, problem = _constrained(client, kind)
            tally.record(kind, status, problem)
        elif kind == "timeout":
            try:
                client.post("/v1/completions", json={"prompt": "Slowly", "max_tokens": 64}, timeout=0.05)
                tally.record(kind, 200)
            except httpx.TimeoutException:
                tally.record(kind, "client-timeout")
        else:
            r = client.post("/v1/completions", content=random.choice(BAD_BODIES),
                            headers={"content-type": "application/json"})
            error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") \
                else {}
            ok = 400 <= r.status_code < 500 and set(error) == {"message", "type", "param", "code"}
            tally.record(kind, r.status_code, None if ok else f"{r.status_code} {r.text[:200]}")
    except httpx.HTTPError as e:
        tally.record(kind, type(e).__name__, f"transport error {e!r}")


def _rss_kib(pid: int) -> int:
    total = 0
    for p in (pid, *descendants(pid)):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def _drained(url: str, timeout_s: float) -> tuple[bool, float]:
    """Whether nothing runs or waits and no KV block is in use, within timeout_s; and how long it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        m = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
        if all(m.get(f"stepahead:{name}", 0.0) == 0.0
               for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")):
            return True, time.monotonic() - start
        time.sleep(0.05)
    return False, timeout_s


def soak(url: str, server_pid: int, duration_s: float, clients: int, seed: int) -> dict:
    tally = Tally()
    deadline = time.monotonic() + duration_s
    rss: list[int] = []

    def client_loop(index: int) -> None:
        random.seed(seed * 1000 + index)
        with httpx.Client(base_url=url, timeout=120) as client:
            while time.monotonic() < deadline:
                _one(client, tally)

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    while time.monotonic() < deadline:  # the memory, every tenth of the run
        time.sleep(min(duration_s / 10, max(0.0, deadline - time.monotonic())))
        rss.append(_rss_kib(server_pid))
    for t in threads:
        t.join()
    drained, drain_s = _drained(url, 10.0)
    end_rss = _rss_kib(server_pid)
    server_errors = sum(n for status, n in tally.statuses.items() if status.startswith("5"))
    return {"duration_s": duration_s, "clients": clients, "requests": sum(tally.kinds.values()),
            "kinds": dict(tally.kinds), "statuses": dict(tally.statuses), "server_errors": server_errors,
            "problems": tally.problems, "drained": drained, "drain_s": round(drain_s, 3),
            "rss_mib": [round(kib / 1024, 1) for kib in rss],
            # Warm-up: the first half of the run (caches, compiled grammars, allocator pools fill).
            "rss_warm_mib": round(rss[len(rss) // 2] / 1024, 1), "rss_end_mib": round(end_rss / 1024, 1),
            "health": httpx.get(url + "/health", timeout=10).status_code}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="model of the server (default: the built-in one)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rss-growth", type=float, default=0.10,
                        help="largest allowed growth of the server's memory from warm-up to the end (fraction)")
    parser.add_argument("--num-kv-blocks", type=int, default=600,
                        help="the server's KV pool (0: its default). The pool's pages become resident as they are "
                             "first written, so memory grows until all of it has been used once: a small pool is "
                             "used up in the warm-up, and preempts under this load too")
    parser.add_argument("--server-arg", action="append", default=[], help="an extra `stepahead serve` argument")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)

    if args.model is None:
        from stepahead.models.loading.loader import builtin_model_path

        args.model = builtin_model_path()
    pool = ["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks else []
    srv = RemoteServer(args.model, *pool, *args.server_arg)
    try:
        result = soak(srv.url, srv.proc.pid, args.duration, args.clients, args.seed)
    finally:
        srv.stop()
    result["server_exit_code"] = srv.proc.returncode
    result["tracebacks_in_log"] = srv.log.count("Traceback")
    growth = result["rss_end_mib"] / max(result["rss_warm_mib"], 1e-9) - 1
    result["rss_growth"] = round(growth, 3)
    result["passed"] = (result["server_errors"] == 0 and not result["problems"] and result["drained"]
                        and result["health"] == 200 and result["server_exit_code"] == 0
                        and result["tracebacks_in_log"] == 0 and growth <= args.max_rss_growth)
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
