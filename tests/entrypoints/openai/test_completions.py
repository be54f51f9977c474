"""/v1/completions through the official openai client against a real server (tiny random Llama)."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.conftest import MODEL_NAME

PROMPT = "def add(a, b):"


def _tokens(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def test_exact_usage_and_length_finish(client, http):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0)
    n_prompt = len(_tokens(http, PROMPT))
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.model == MODEL_NAME
    assert len(out.choices) == 1
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == n_prompt
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == n_prompt + 5


def test_default_max_tokens_is_16(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16
    assert out.choices[0].finish_reason == "length"


def test_model_may_be_omitted(http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL_NAME


def test_token_id_prompts_match_text_prompts(client, http):
    ids = _tokens(http, PROMPT)
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage == by_text.usage


def test_batch_of_prompts_in_input_order(client, http):
    prompts = ["import os", "class Foo:", "return x"]
    singles = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=4, temperature=0).choices[0].text
               for p in prompts]
    batch = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == singles
    assert batch.usage.prompt_tokens == sum(len(_tokens(http, p)) for p in prompts)
    assert batch.usage.completion_tokens == 12
    # A list of token-id lists is a batch too.
    ids = client.completions.create(model=MODEL_NAME, prompt=[_tokens(http, p) for p in prompts], max_tokens=4,
                                    temperature=0)
    assert [c.text for c in ids.choices] == singles


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == echoed.choices[0].text


def test_n2_sampling(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=7,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 16
    assert all(c.finish_reason == "length" for c in out.choices)
    # Seeded: the same request gives the same two choices; the two choices use different noise.
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    assert out.choices[0].text != out.choices[1].text


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_equals_non_streamed_with_one_finish_chunk_per_choice(client, n):
    prompts = [PROMPT, "while True:"]
    kwargs = dict(model=MODEL_NAME, prompt=prompts, max_tokens=12, temperature=0, n=n)
    full = client.completions.create(**kwargs)
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        assert chunk.object == "text_completion"
        assert chunk.usage is None
        for c in chunk.choices:
            assert c.text or c.finish_reason, "empty delta"
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    assert texts == {c.index: c.text for c in full.choices}
    assert finishes == {c.index: [c.finish_reason] for c in full.choices}


def test_stream_usage_only_when_asked(client, http):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == []
    assert last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens == len(_tokens(http, PROMPT))
    assert all(c.usage is None and c.choices for c in body)
    raw = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True}).text
    assert '"usage"' not in raw
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_stop_string_sets_stop_reason(client):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[3:6]
    assert stop.strip(), f"need a non-blank stop string from {base!r}"
    cut = base[:base.find(stop)]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    c = out.choices[0]
    assert c.finish_reason == "stop"
    assert c.stop_reason == stop
    assert c.text == cut
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                              stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == cut
    assert [ch.choices[0].stop_reason for ch in streamed if ch.choices[0].finish_reason] == [stop]


def test_stop_token_ids(client, http):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}, logprobs=0)
    first = base.choices[0].logprobs.tokens[0]
    first_id = _tokens(http, first)
    assert len(first_id) == 1, first
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"stop_token_ids": first_id, "ignore_eos": True})
    c = out.choices[0]
    assert (c.finish_reason, c.stop_reason, out.usage.completion_tokens) == ("stop", first_id[0], 1)


def test_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0.0
        assert 1 <= len(top) <= 4
        # Greedy: the sampled token is the most likely one.
        assert tok in top and top[tok] == pytest.approx(max(top.values()))
    assert lp.text_offset == sorted(lp.text_offset)
    zero = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    assert all(len(t) == 1 for t in zero.choices[0].logprobs.top_logprobs)
    assert zero.choices[0].logprobs.tokens == lp.tokens
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                              logprobs=3, stream=True))
    tokens = [t for ch in streamed for t in ch.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=123,
              extra_body={"ignore_eos": True, "top_k": 50})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_server_matches_offline_llm(client, tiny_llama):
    """The server path (engine process, ZMQ, HTTP) produces exactly what the offline LLM produces."""
    from stepahead import LLM, SamplingParams

    prompts = ["def add(a, b):", "import sys\n", "class Node:\n    def __init__(self):"]
    llm = LLM(str(tiny_llama), dtype="float32", executor="uni", num_kv_blocks=128, num_threads=1)
    try:
        offline = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.shutdown()
    served = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=20, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert [c.text for c in served.choices] == [o.outputs[0].text for o in offline]
