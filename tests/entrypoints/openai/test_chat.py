"""/v1/chat/completions through the official openai client against a real server."""

from __future__ import annotations

from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.tiny_models import CHATML_TEMPLATE

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


def _chat_prompt_tokens(http, messages, add_generation_prompt=True) -> list[int]:
    r = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": add_generation_prompt})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_chat_non_stream(client, http):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens == len(_chat_prompt_tokens(http, MESSAGES))


def test_chat_template_renders_chatml(http):
    r = http.post("/tokenize", json={"messages": MESSAGES, "return_token_strs": True})
    ids = r.json()["tokens"]
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert CHATML_TEMPLATE  # the tiny model's template
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay hi.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    without = _chat_prompt_tokens(http, MESSAGES, add_generation_prompt=False)
    assert ids[:len(without)] == without and len(ids) > len(without)


def test_content_parts_equal_plain_content(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]
    plain = [{"role": "user", "content": "Say hi."}]
    a = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=5, temperature=0)
    b = client.chat.completions.create(model=MODEL_NAME, messages=plain, max_tokens=5, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_stream_matches_non_stream(client):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10, temperature=0, n=2,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    *body, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage == full.usage
    first_per_choice: dict[int, object] = {}
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for ch in body:
        assert ch.object == "chat.completion.chunk" and ch.usage is None
        (c,) = ch.choices
        if c.index not in first_per_choice:
            first_per_choice[c.index] = c
            assert c.delta.role == "assistant" and not c.delta.content and c.finish_reason is None
            continue
        assert c.delta.content or c.finish_reason, "empty delta"
        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        if c.finish_reason:
            finishes.setdefault(c.index, []).append(c.finish_reason)
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finishes == {c.index: [c.finish_reason] for c in full.choices}


def test_default_max_tokens_fills_the_context(client, http):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0,
                                         extra_body={"ignore_eos": True})
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == max_model_len


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy picks the top-ranked token
        assert t.logprob == t.top_logprobs[0].logprob
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert bytes(t.bytes).decode() == t.token
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None
    streamed = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3, stream=True,
                                              extra_body={"ignore_eos": True})
    tokens = [t.token for ch in streamed if ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert tokens == [t.token for t in content]


def test_chat_stop_string(client):
    base = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    stop = base[2:4]
    assert stop.strip(), base
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                         stop=stop, extra_body={"ignore_eos": True})
    c = out.choices[0]
    assert (c.finish_reason, c.message.content) == ("stop", base[:base.find(stop)])
    assert c.model_extra["stop_reason"] == stop
