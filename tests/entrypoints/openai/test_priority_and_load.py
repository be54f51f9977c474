"""`stepahead serve --scheduling-policy priority --max-num-seqs 1 --enable-server-load-tracking`: a request
sent later with a better priority finishes before an earlier one with a worse priority, and GET /load
counts the generation requests in progress.

One seat: a first request that writes until it is closed holds it while the two others arrive; whatever
the timing, the urgent one goes first (it is either admitted first or takes the seat of the other).
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer, wait_until

MODEL = "tiny-long"


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    model = tiny_model_factory("llama", max_position_embeddings=2048)
    srv = RemoteServer(model, "--served-model-name", MODEL, "--scheduling-policy", "priority", "--max-num-seqs", "1",
                       "--enable-server-load-tracking", "--enable-prompt-tokens-details", "--executor", "uni")
    yield srv
    srv.stop()


def _load(http: httpx.Client) -> int:
    return http.get("/load").json()["server_load"]


def test_a_later_request_with_a_better_priority_finishes_first(server):
    finished: list[str] = []
    body = {"model": MODEL, "prompt": "hello", "temperature": 0, "ignore_eos": True}

    def send(name: str, priority: int, max_tokens: int) -> None:
        with httpx.Client(base_url=server.url, timeout=300) as c:
            r = c.post("/v1/completions", json=body | {"priority": priority, "max_tokens": max_tokens})
        assert r.status_code == 200, r.text
        finished.append(name)

    with httpx.Client(base_url=server.url, timeout=300) as http:
        assert _load(http) == 0
        holder = body | {"priority": 0, "max_tokens": 2000, "stream": True}
        with http.stream("POST", "/v1/completions", json=holder) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # the holder runs
            earlier = threading.Thread(target=send, args=("earlier", 5, 24))
            earlier.start()
            assert wait_until(lambda: _load(http) == 2)
            later = threading.Thread(target=send, args=("later", 1, 8))
            later.start()
            assert wait_until(lambda: _load(http) == 3)
        # Closing the holder's stream aborts it: the seat goes to the most urgent request.
        earlier.join()
        later.join()
        assert finished == ["later", "earlier"]
        assert wait_until(lambda: _load(http) == 0)


def test_cache_salt_and_request_id(server):
    """A prompt cached under one salt is not found under another; the client's request_id names the response."""
    body = {"model": MODEL, "prompt": [5 + i for i in range(64)], "max_tokens": 2, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=300) as http:
        def cached(**fields) -> int:
            r = http.post("/v1/completions", json=body | fields)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(cache_salt="tenant-a") == 0
        assert cached(cache_salt="tenant-a") == 48  # whole blocks of 16, the last position recomputed
        assert cached(cache_salt="tenant-b") == 0
        assert cached() == 0
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 1, "request_id": "my-id-7"})
        assert r.json()["id"] == "chatcmpl-my-id-7"


def test_priority_is_refused_under_fcfs_offline(tiny_llama):
    from stepahead import LLM, SamplingParams

    with LLM(str(tiny_llama), executor="uni") as llm:
        with pytest.raises(ValueError, match="priority needs the priority scheduling policy"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])
        with pytest.raises(ValueError, match="one entry per prompt"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0, 0])
