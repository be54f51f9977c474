"""Clients that leave: their requests are aborted in the engine and every KV block returns to the pool."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx

from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.entrypoints.openai.server_utils import metric, parse_metrics, wait_until

LONG = {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def _metrics(http) -> dict[str, float]:
    return parse_metrics(http.get("/metrics").text)


def _engine_idle(http) -> bool:
    m = _metrics(http)
    return (metric(m, "stepahead:num_requests_running") == 0 and metric(m, "stepahead:num_requests_waiting") == 0
            and metric(m, "stepahead:kv_cache_free_blocks") == metric(m, "stepahead:kv_cache_total_blocks"))


async def _cut_after(client: httpx.AsyncClient, path: str, body: dict, events: int) -> int:
    """Stream a request and hang up after `events` data events; returns how many were read."""
    seen = 0
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                assert "error" not in json.loads(line[6:])
                seen += 1
                if seen >= events:
                    break
    return seen


def test_disconnect_storm_aborts_everything(http, server):
    assert wait_until(lambda: _engine_idle(http))
    aborted_before = metric(_metrics(http), "stepahead:request_success_total", finished_reason="abort")

    async def storm() -> list[int]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            tasks = [_cut_after(c, "/v1/completions", {**LONG, "prompt": f"x = {i}"}, 3) for i in range(25)]
            chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "go"}], "max_tokens": 400,
                    "ignore_eos": True}
            tasks += [_cut_after(c, "/v1/chat/completions", chat, 4) for _ in range(25)]
            return await asyncio.gather(*tasks)

    assert all(n >= 3 for n in asyncio.run(storm()))
    # A fresh request completes while (or right after) the aborts land.
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "ok", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    # The engine ends with nothing running and the whole pool free: no leaked request, no leaked block.
    assert wait_until(lambda: _engine_idle(http)), _metrics(http)
    m = _metrics(http)
    assert metric(m, "stepahead:request_success_total", finished_reason="abort") - aborted_before == 50
    generated = metric(m, "stepahead:generation_tokens_total")
    assert generated < 50 * 400  # nowhere near running the aborted requests to their end


def test_non_streaming_disconnect_aborts(http, server):
    assert wait_until(lambda: _engine_idle(http))
    before = metric(_metrics(http), "stepahead:request_success_total", finished_reason="abort")
    body = json.dumps({**LONG, "max_tokens": 480}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert wait_until(lambda: metric(_metrics(http), "stepahead:request_success_total",
                                     finished_reason="abort") == before + 1)
    assert wait_until(lambda: _engine_idle(http))
