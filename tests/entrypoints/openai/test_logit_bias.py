"""logit_bias and allowed_token_ids on the server, through the openai client."""

from __future__ import annotations

from tests.entrypoints.openai.conftest import MODEL_NAME

PROMPT = "def main(argv):\n    parser = "


def test_logit_bias_forces_a_token_greedily(client, http):
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    forced = 7
    ids = http.post("/tokenize", json={"prompt": plain, "add_special_tokens": False}).json()["tokens"]
    assert ids[:1] != [forced]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    text = http.post("/detokenize", json={"tokens": [forced] * 4}).json()["prompt"]
    assert out.choices[0].text == text
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0, logit_bias={str(forced): 100},
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == http.post("/detokenize", json={"tokens": [forced] * 3}).json()["prompt"]


def test_allowed_token_ids_restrict_what_is_sampled(client):
    allowed = [11, 12]
    for temperature in (0, 1.0):
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=temperature,
                                        logprobs=0, seed=3, extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
        tokens = out.choices[0].logprobs.tokens
        assert len(tokens) == 6
        assert all(out.choices[0].logprobs.top_logprobs[i] for i in range(6))
        assert set(tokens) <= _token_strs(client, allowed)


def _token_strs(client, ids: list[int]) -> set[str]:
    """The text each id's logprob entry carries, read from a response forced to that id."""
    strs = set()
    for token_id in ids:
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0,
                                        logit_bias={str(token_id): 100}, extra_body={"ignore_eos": True})
        strs.update(out.choices[0].logprobs.tokens)
    return strs
