"""No single request can stall, starve or exhaust the server: cheap refusals before heavy work, heavy
work off the event loop, bounded logging of unknown fields, client chat templates only when trusted."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.entrypoints.openai.server_utils import RemoteServer
from tests.entrypoints.openai.test_errors import _check_error
from tests.test_grammar_bounds import nested_arrays, nested_objects

COMPLETION = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 16, "ignore_eos": True}
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
# (endpoint, body, expected status, param) sent by a hostile client.
HOSTILE = [
    ("/v1/completions", {**COMPLETION, "prompt": "a" * (10 << 20)}, 400, "prompt"),  # 10 MiB: refused untokenized
    ("/v1/completions", {**COMPLETION, "prompt": "word " * 6000}, 400, None),  # tokenized off the loop; too long
    ("/tokenize", {"model": MODEL_NAME, "prompt": "word " * 6000}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["hello"] * 400, "n": 128}, 400, "n"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"chat_template": NESTED_LOOPS}}, 400, "chat_template"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                              "chat_template": NESTED_LOOPS}, 400, "chat_template"),
    # Schemas deep enough to break a recursive walk (pickling, JSON encoding) or to parse for seconds.
    ("/v1/completions", {**COMPLETION, "response_format": {"type": "json_schema", "json_schema": {
        "name": "d", "schema": nested_objects(250)}}}, 400, "response_format"),
    ("/v1/completions", {**COMPLETION, "guided_json": nested_arrays(900)}, 400, "structured_outputs"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                              "structured_outputs": {"json": nested_objects(400)}}, 400, "structured_outputs"),
    # Refusals quote a short prefix of what they refuse (checked below), not megabytes.
    ("/v1/completions", {**COMPLETION, "stop": ["x" * 1000] * 999 + [""]}, 400, "stop"),
    ("/v1/completions", {**COMPLETION, "model": "m" * 100_000}, 404, "model"),
    # The Responses API runs as a chat completion: the same refusals, naming its own fields.
    ("/v1/responses", {"model": MODEL_NAME, "input": [{"role": "user", "content": "a" * (10 << 20)}]}, 400, "input"),
    ("/v1/responses", {"model": MODEL_NAME, "input": [{"role": "user", "content": "hi"}] * 100_000}, 400, "input"),
    ("/v1/responses", {"model": MODEL_NAME, "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "d", "schema": nested_objects(250)}}}, 400, "text"),
    ("/v1/responses", {"model": MODEL_NAME, "input": "hi", "previous_response_id": "r" * 100_000}, 404,
     "previous_response_id"),
    ("/v1/completions", {**COMPLETION, "prompt_logprobs": 10**6}, 400, "prompt_logprobs"),
]


@pytest.mark.parametrize("endpoint,body,status,param", HOSTILE, ids=[f"{e}-{i}" for i, (e, *_) in enumerate(HOSTILE)])
def test_hostile_request_is_refused_while_the_server_keeps_serving(server, http, endpoint, body, status, param):
    result: dict = {}

    def hostile() -> None:
        result["response"] = httpx.post(server.url + endpoint, json=body, timeout=120)

    _serve_meanwhile(http, hostile)
    _check_error(result["response"], status, param)
    assert len(result["response"].text) < 4096


def _serve_meanwhile(http, work) -> None:
    """Run work on a thread while health checks and small completions go on; they must stay quick."""
    thread = threading.Thread(target=work)
    thread.start()
    health_s, completion_s = [], []
    while thread.is_alive() or not health_s:
        started = time.monotonic()
        assert http.get("/health").status_code == 200
        health_s.append(time.monotonic() - started)
        started = time.monotonic()
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200
        completion_s.append(time.monotonic() - started)
    thread.join()
    # Generous bounds: they check that the event loop stayed free, not speed.
    assert max(health_s) < 1.0 and max(completion_s) < 5.0, (health_s, completion_s)


def test_long_prompt_logprobs_keep_the_server_serving(server, http):
    """A long prompt's logprobs at the most top-N (hundreds of positions, 21 entries each) are computed in
    the prefill and decoded and serialized without holding the event loop."""
    result: dict = {}
    body = {**COMPLETION, "prompt": "word and more words " * 60, "max_tokens": 0, "echo": True, "logprobs": 20,
            "prompt_logprobs": 20}

    def scoring() -> None:
        result["response"] = httpx.post(server.url + "/v1/completions", json=body, timeout=300)

    _serve_meanwhile(http, scoring)
    r = result["response"]
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["prompt_logprobs"]) == len(choice["logprobs"]["tokens"]) > 300


def test_body_over_the_limit_is_413(server):
    huge = b'{"prompt": "' + b"a" * (17 << 20) + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=huge, headers={"content-type": "application/json"},
                   timeout=120)
    _check_error(r, 413, None, "larger than")

    def chunks():  # no content-length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(17):
            yield b"a" * (1 << 20)
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=120)
    _check_error(r, 413, None, "larger than")


def _rss_mb(pid: int) -> float:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024


def test_unique_unknown_fields_keep_memory_and_log_flat(server, http):
    def send(round_: int) -> None:
        extra = {f"unknown_{round_}_{i}_{'x' * 40}": 1 for i in range(20000)}
        r = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text

    send(-1)  # settle allocator pools first
    before = _rss_mb(server.proc.pid)
    for round_ in range(10):
        send(round_)
    growth = _rss_mb(server.proc.pid) - before
    assert growth < 20, f"API server RSS grew {growth:.1f} MB"
    lines = [line for line in server.lines if "present in the request but ignored" in line]
    assert sum(len(line) for line in lines) < 20000  # bounded: 64 names of at most 64 characters, in all


def test_trusted_request_template_renders_off_the_loop(tiny_llama):
    srv = RemoteServer(tiny_llama, "--served-model-name", MODEL_NAME, "--num-kv-blocks", "64", "--executor", "uni",
                       "--trust-request-chat-template")
    try:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2,
                "chat_template": "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"}
        r = httpx.post(srv.url + "/tokenize", json={"model": MODEL_NAME, "prompt": "<<hello there>>"}, timeout=60)
        expected = r.json()["count"]
        r = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == expected
        # A runaway template is cut at the time limit (its child process is terminated), one that renders
        # too much at the size limit; /health answers meanwhile, and the next template renders again.
        evil = {**body, "chat_template": NESTED_LOOPS}
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(r=httpx.post(srv.base_url + "/chat/completions",
                                                                              json=evil, timeout=60)))
        thread.start()
        while thread.is_alive():
            started = time.monotonic()
            assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
            assert time.monotonic() - started < 1.0
            time.sleep(0.2)
        _check_error(result["r"], 400, "chat_template", "did not finish rendering")
        huge = {**body, "chat_template": "{{ 'a' * 3000000 }}"}
        _check_error(httpx.post(srv.base_url + "/chat/completions", json=huge, timeout=60), 400, "chat_template",
                     "more than")
        r = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == expected
    finally:
        srv.stop()


def test_openapi_documents_what_the_server_answers(http):
    schema = http.get("/openapi.json").json()
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (path, method)
            if method == "post":
                assert {"400", "404", "413", "503"} <= set(operation["responses"]), (path, method)
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_405_says_which_methods_are_allowed(http):
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == 405


def test_served_model_name_defaults_to_the_folder_name(tiny_llama):
    srv = RemoteServer(tiny_llama, "--num-kv-blocks", "64", "--executor", "uni")
    try:
        models = httpx.get(srv.base_url + "/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == [Path(tiny_llama).name] and models[0]["root"] == str(tiny_llama)
    finally:
        srv.stop()


def test_logprob_bytes_are_each_tokens_raw_bytes(http):
    """Joined, the tokens' bytes are the reply's UTF-8, even where a token holds part of a character."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "héllo wörld ✓ 日本"}], "max_tokens": 24,
            "temperature": 1.0, "seed": 7, "logprobs": True, "top_logprobs": 2}
    reply = http.post("/v1/chat/completions", json=body).json()
    content = reply["choices"][0]["message"]["content"]
    tokens = reply["choices"][0]["logprobs"]["content"]
    joined = b"".join(bytes(t["bytes"]) for t in tokens)
    assert joined.decode("utf-8", errors="replace") == content
    assert all(isinstance(top["bytes"], list) for t in tokens for top in t["top_logprobs"])


def test_token_bytes_of_the_builtin_tokenizer():
    from stepahead.entrypoints.openai.token_bytes import TokenBytes
    from stepahead.models.loading.loader import load_model_config, load_tokenizer

    tokenizer = load_tokenizer(load_model_config(None, "cpu"))
    raw = TokenBytes(tokenizer)
    text = "Ünïcode ✓ 日本語 and plain words"
    assert b"".join(raw(i) for i in tokenizer.encode(text, add_special_tokens=False)).decode() == text


def test_text_offsets_index_the_returned_text(http):
    """Sampled text with multi-byte characters: every offset is inside the text, in order, and a token
    starts where its predecessors' text ends (streamed and not)."""
    body = {"model": MODEL_NAME, "prompt": "héllo wörld ✓ 日本", "max_tokens": 24, "temperature": 1.0, "seed": 3,
            "logprobs": 1, "ignore_eos": True}
    for seed in range(3, 8):
        reply = http.post("/v1/completions", json={**body, "seed": seed}).json()["choices"][0]
        text, offsets = reply["text"], reply["logprobs"]["text_offset"]
        assert offsets == sorted(offsets) and offsets[0] == 0
        assert all(0 <= o <= len(text) for o in offsets), (offsets, len(text))
