"""vLLM's completion/test_completion.py, case by case, against `stepahead serve` on the tiny model.

Where vLLM asserts a count or a text of its own model (opt-125m's 6 prompt tokens, finishing at
different lengths), the port asserts what the tiny model's tokenizer says or the shape instead."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.vllm_compat.conftest import MODEL

ZEROS = [0, 0, 0, 0, 0]


def test_single_completion(client, tokenizer):
    prompt = "Hello, my name is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0)
    assert out.id and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length" and len(out.choices[0].text) >= 1
    n_prompt = len(tokenizer.encode(prompt))  # vLLM: opt-125m's 6
    assert (out.usage.completion_tokens, out.usage.prompt_tokens, out.usage.total_tokens) == (5, n_prompt, n_prompt + 5)
    assert out.usage.prompt_tokens_details is not None and out.usage.prompt_tokens_details.cached_tokens == 0
    by_ids = client.completions.create(model=MODEL, prompt=ZEROS, max_tokens=5, temperature=0.0)
    assert by_ids.usage.completion_tokens == 5  # vLLM checks the text; the tiny model may say only special tokens
    assert getattr(by_ids.choices[0], "prompt_logprobs", None) is None


def test_completion_truncation_side_controls_prompt_truncation(client):
    ids = list(range(8))
    for side, kept in (("right", ids[:4]), ("left", ids[-4:])):
        out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0.0, extra_body={
            "return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": side})
        assert out.choices[0].prompt_token_ids == kept


def test_no_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=ZEROS, max_tokens=5, temperature=0.0, logprobs=None)
    assert out.choices[0].logprobs is None


def test_zero_logprobs(client):
    lp = client.completions.create(model=MODEL, prompt=ZEROS, max_tokens=5, temperature=0.0, logprobs=0).choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.top_logprobs[0]) == 1  # the sampled token itself


def test_some_logprobs(client):
    lp = client.completions.create(model=MODEL, prompt=ZEROS, max_tokens=5, temperature=0.0, logprobs=5).choices[0].logprobs
    assert lp.token_logprobs is not None and 5 <= len(lp.top_logprobs[0]) <= 6


def test_too_many_completion_logprobs(client):
    with pytest.raises(openai.BadRequestError):  # the server's max_logprobs is 20, as vLLM's
        client.completions.create(model=MODEL, prompt=ZEROS, max_tokens=5, temperature=0.0, logprobs=21)
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        for _ in client.completions.create(model=MODEL, prompt=ZEROS, max_tokens=5, temperature=0.0, logprobs=30,
                                           stream=True):
            pass
    out = client.completions.create(model=MODEL, prompt=ZEROS, max_tokens=5, temperature=0.0)
    assert out.choices[0].finish_reason == "length"  # still serving


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, None])
def test_prompt_logprobs_completion(client, prompt_logprobs):
    kw: dict = {"model": MODEL, "prompt": ["A robot may not injure another robot", "My name is"]}
    if prompt_logprobs is not None:
        kw["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):  # the whole vocabulary is more than max_logprobs
            client.completions.create(**kw)
        return
    out = client.completions.create(**kw)
    for choice in out.choices:
        if prompt_logprobs is None:
            assert getattr(choice, "prompt_logprobs", None) is None
        else:
            assert len(choice.prompt_logprobs) > 0


def test_completion_streaming(client):
    kw = {"model": MODEL, "prompt": "What is an LLM?", "max_tokens": 5, "temperature": 0.0}
    whole = client.completions.create(**kw).choices[0].text
    texts, finishes = [], 0
    for chunk in client.completions.create(**kw, stream=True):
        texts.append(chunk.choices[0].text)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == 1 and chunk.choices[0].finish_reason == "length" and chunk.choices[0].text
    assert "".join(texts) == whole


def test_parallel_no_streaming(client):
    """n=3 at temperature 1: three indexed, finished, distinct samples. (vLLM also asserts they finished at
    different lengths: its model ends sentences; a random model stops at max_tokens.)"""
    out = client.completions.create(model=MODEL, prompt="What is an LLM?", max_tokens=50, n=3, temperature=1.0,
                                    logprobs=0, seed=42)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason is not None for c in out.choices)
    assert all(len(c.logprobs.tokens) >= 1 for c in out.choices)
    assert len({c.text for c in out.choices}) == 3


def test_parallel_streaming(client):
    """The n samples' deltas interleave in one stream, told apart by index (length caveat as above)."""
    n, max_tokens = 3, 50
    texts: list[list[str]] = [[] for _ in range(n)]
    finishes = 0
    for chunk in client.completions.create(model=MODEL, prompt="What is an LLM?", max_tokens=max_tokens, n=n,
                                           temperature=1.0, stream=True, seed=42):
        choice = chunk.choices[0]
        texts[choice.index].append(choice.text)
        finishes += choice.finish_reason is not None
    assert finishes == n
    assert all(len(parts) <= max_tokens for parts in texts)
    assert len({"".join(parts) for parts in texts}) == n


def _check_usage(u) -> None:
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_completion_stream_options(client):
    kw = {"model": MODEL, "prompt": "What is the capital of France?", "max_tokens": 5, "temperature": 0.0}
    for options in ({"include_usage": False, "continuous_usage_stats": False},
                    {"include_usage": False, "continuous_usage_stats": True}, {}):
        assert all(chunk.usage is None for chunk in client.completions.create(**kw, stream=True, stream_options=options))
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason is not None
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    _check_usage(chunks[-1].usage)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True,
                                                                              "continuous_usage_stats": True}))
    for chunk in chunks:
        _check_usage(chunk.usage)
    assert chunks[-2].choices[0].finish_reason is not None and chunks[-1].choices == []
    for options in ({"include_usage": None}, {"include_usage": True}, {"continuous_usage_stats": None},
                    {"continuous_usage_stats": True}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**kw, stream=False, stream_options=options)


def test_batch_completions(client):
    """vLLM's n=2 step asks for beam search, which stepahead refuses by name; the rest as vLLM's."""
    for prompts in (["Hello, my name is"] * 2, [ZEROS] * 2):
        batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0.0)
        assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text
        with pytest.raises(openai.BadRequestError, match="use_beam_search"):
            client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0.0,
                                      extra_body={"use_beam_search": True})
        texts = ["", ""]
        for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0.0, stream=True):
            assert len(chunk.choices) == 1
            texts[chunk.choices[0].index] += chunk.choices[0].text
        assert texts[0] == texts[1]


@pytest.mark.parametrize("logprobs_arg", [1, 0])
def test_echo_logprob_completion(client, tokenizer, logprobs_arg):
    for prompt in ("Hello, my name is", ZEROS):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0, echo=True,
                                        logprobs=logprobs_arg)
        prompt_text = tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
        assert out.choices[0].text.startswith(prompt_text)
        lp = out.choices[0].logprobs
        assert len(lp.text_offset) > 5 and len(lp.tokens) > 5
        assert len(lp.token_logprobs) > 5 and lp.token_logprobs[0] is None
        assert len(lp.top_logprobs) > 5 and lp.top_logprobs[0] is None
        for top in lp.top_logprobs[1:]:
            assert max(logprobs_arg, 1) <= len(top) <= logprobs_arg + 1


def test_invalid_json_schema(client):
    schema = {"type": "object", "properties": {"brand": {"type": "string"}, "foo": "bar"}, "required": ["brand"]}
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.completions.create(model=MODEL, prompt="A car as JSON:", extra_body={"structured_outputs": {"json": schema}})


def test_invalid_regex(client):
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.completions.create(model=MODEL, prompt="An email address:",
                                  extra_body={"structured_outputs": {"regex": r"[.*"}, "stop": ["\n"]})


def test_invalid_grammar(client):
    grammar = 'root ::= select_statementinvalidsyntax\nselect_statement ::= "SELECT " column\ncolumn ::= "col_1 "\n'
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.completions.create(model=MODEL, prompt="An SQL query:",
                                  extra_body={"structured_outputs": {"grammar": grammar}})


