"""vLLM's test_return_tokens_as_ids.py: logprobs' tokens as "token_id:N", asked by the server flag
(--return-tokens-as-token-ids, the folder's flags server) or per request (the folder's shared server)."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.vllm_compat.conftest import MODEL


@pytest.fixture(params=[True, False], ids=["server_flag", "request_field"])
def client_and_body(request):
    if request.param:
        return request.getfixturevalue("flags_client"), {}
    return request.getfixturevalue("client"), {"return_tokens_as_token_ids": True}


def _ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens)
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_completion_return_tokens_as_token_ids_completion(client_and_body, tokenizer):
    client, body = client_and_body
    # 🎉 is more than one token, so a character is split across tokens
    out = client.completions.create(model=MODEL, prompt="Say 'Hello, world! 🎉'", echo=True, temperature=0,
                                    max_tokens=10, logprobs=1, extra_body=body)
    lp = out.choices[0].logprobs
    # the first prompt token has no logprob; every other's top entry is keyed the same way as its token
    assert lp.tokens[1:] == [next(iter(top)) for top in lp.top_logprobs[1:]]
    assert out.choices[0].text == tokenizer.decode(_ids(lp.tokens), skip_special_tokens=True)


def test_chat_return_tokens_as_token_ids_completion(client_and_body, tokenizer):
    client, body = client_and_body
    out = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8, logprobs=True, extra_body=body,
        messages=[{"role": "system", "content": "You like to respond in only emojis, like 🎉"},
                  {"role": "user", "content": "Please write some emojis: 🐱🐶🎉"}])
    ids = _ids([entry.token for entry in out.choices[0].logprobs.content])
    assert tokenizer.decode(ids, skip_special_tokens=True) == out.choices[0].message.content
