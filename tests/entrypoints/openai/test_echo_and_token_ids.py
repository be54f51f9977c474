"""Chat echo (vLLM's: the assistant's last message goes before the output) and return_tokens_as_token_ids."""

from __future__ import annotations

import re

from tests.entrypoints.openai.conftest import MODEL_NAME

PARTIAL = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One two"}]
CONTINUE = dict(model=MODEL_NAME, messages=PARTIAL, max_tokens=5, temperature=0,
                extra_body={"ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True})
TOKEN_ID = re.compile(r"^token_id:(\d+)$")


def _with(kw: dict, **extra) -> dict:
    return {**kw, "extra_body": {**kw["extra_body"], **extra}}


def test_chat_echo_prepends_the_assistant_message(client):
    plain = client.chat.completions.create(**CONTINUE).choices[0].message.content
    echoed = client.chat.completions.create(**_with(CONTINUE, echo=True)).choices[0].message.content
    assert echoed == "One two" + plain
    stream = client.chat.completions.create(**_with(CONTINUE, echo=True), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == echoed
    # The last message is the user's: nothing to echo.
    kw = dict(model=MODEL_NAME, messages=PARTIAL[:1], max_tokens=4, temperature=0)
    assert client.chat.completions.create(**kw, extra_body={"echo": True}).choices[0].message.content == \
        client.chat.completions.create(**kw).choices[0].message.content


def test_completion_tokens_as_token_ids(client, http):
    kw = dict(model=MODEL_NAME, prompt="hello there", max_tokens=5, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0]
    as_ids = client.completions.create(**{**kw, "extra_body": {**kw["extra_body"],
                                                               "return_tokens_as_token_ids": True}}).choices[0]
    ids = [int(TOKEN_ID.match(token).group(1)) for token in as_ids.logprobs.tokens]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == plain.text == as_ids.text
    assert as_ids.logprobs.token_logprobs == plain.logprobs.token_logprobs
    assert all(TOKEN_ID.match(key) for top in as_ids.logprobs.top_logprobs for key in top)


def test_chat_tokens_as_token_ids(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=PARTIAL[:1], max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    for entry in out.choices[0].logprobs.content:
        assert TOKEN_ID.match(entry.token) and bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 2 and all(TOKEN_ID.match(top.token) for top in entry.top_logprobs)
