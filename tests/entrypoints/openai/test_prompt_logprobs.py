"""Prompt logprobs on the server: vLLM's `prompt_logprobs` field, and completions' echo with logprobs
(max_tokens 0 included), against a transformers float32 forward of the same prompt."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.tiny_models import hf_prompt_logprobs

PROMPT = "def main(argv):\n    parser = argparse"
TOP = 3


@pytest.fixture(scope="module")
def prompt_ids(http) -> list[int]:
    return http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]


@pytest.fixture(scope="module")
def reference(tiny_llama, prompt_ids):
    return hf_prompt_logprobs(tiny_llama, [prompt_ids], TOP)[0]


def _complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _assert_vllm_form(prompt_logprobs: list, prompt_ids: list[int], reference) -> None:
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for p in range(1, len(prompt_ids)):
        entries = {int(token_id): entry for token_id, entry in prompt_logprobs[p].items()}
        assert set(entries) == set(reference[p])
        for token_id, entry in entries.items():
            assert set(entry) == {"logprob", "rank", "decoded_token"}
            assert entry["rank"] == reference[p][token_id][1]
            assert entry["logprob"] == pytest.approx(reference[p][token_id][0], abs=1e-4)


def test_completions_prompt_logprobs_field(http, prompt_ids, reference):
    body = _complete(http, max_tokens=2, prompt_logprobs=TOP)
    _assert_vllm_form(body["choices"][0]["prompt_logprobs"], prompt_ids, reference)
    plain = _complete(http, max_tokens=2)
    assert "prompt_logprobs" in plain["choices"][0] and plain["choices"][0]["prompt_logprobs"] is None


def test_chat_prompt_logprobs_field(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 2, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    lps = body["prompt_logprobs"]
    assert len(lps) == body["usage"]["prompt_tokens"] and lps[0] is None
    assert all(1 <= len(entry) <= 2 for entry in lps[1:])


def test_echo_with_logprobs_and_no_new_tokens(http, client, prompt_ids, reference):
    """The completions API's scoring form (what evaluation harnesses send): the prompt's own
    logprobs, the first token's None, nothing generated."""
    body = _complete(http, max_tokens=0, echo=True, logprobs=TOP)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(prompt_ids)
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(prompt_ids) == len(lps["text_offset"])
    assert "".join(lps["tokens"]) == PROMPT
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for p in range(1, len(prompt_ids)):
        assert lps["token_logprobs"][p] == pytest.approx(reference[p][prompt_ids[p]][0], abs=1e-4)
        assert len(lps["top_logprobs"][p]) in (TOP, TOP + 1)
    assert lps["text_offset"] == sorted(lps["text_offset"]) and lps["text_offset"][0] == 0
    # The openai client reads the same.
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                    temperature=0)
    assert out.choices[0].logprobs.token_logprobs == pytest.approx(
        [None, *lps["token_logprobs"][1:]], abs=1e-6)


def test_echo_with_logprobs_then_new_tokens(http, prompt_ids):
    plain = _complete(http, max_tokens=4, logprobs=2, ignore_eos=True)["choices"][0]
    echoed = _complete(http, max_tokens=4, echo=True, logprobs=2, ignore_eos=True)["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    n = len(prompt_ids)
    assert echoed["logprobs"]["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-6)
    assert echoed["logprobs"]["tokens"][n:] == plain["logprobs"]["tokens"]
    assert echoed["logprobs"]["text_offset"][n] == len(PROMPT)
    assert echoed["prompt_logprobs"] is None  # not asked for by name


def test_echo_with_logprobs_streamed(http):
    whole = _complete(http, max_tokens=3, echo=True, logprobs=1, ignore_eos=True)["choices"][0]
    text, token_logprobs = "", []
    with http.stream("POST", "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0,
                                                      "max_tokens": 3, "echo": True, "logprobs": 1,
                                                      "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                if choice["logprobs"] is not None:
                    token_logprobs += choice["logprobs"]["token_logprobs"]
    assert text == whole["text"]
    assert token_logprobs == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-6)
