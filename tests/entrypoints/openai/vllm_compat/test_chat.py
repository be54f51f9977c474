"""vLLM's chat_completion/test_chat.py (the base-model cases; the LoRA ones do not apply) against
`stepahead serve` on the tiny model.

vLLM's model (zephyr-7b) answers "2" to "what is 1+1?"; a random model answers noise, so where vLLM
asserts an answer the port asserts the form (valid JSON, a schema, the same output for two spellings of
one request). Sampled requests that vLLM expects to differ carry two seeds, so each outcome is fixed."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import jsonschema
import openai
import pytest

from tests.entrypoints.openai.vllm_compat.conftest import MODEL

ASK = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "what is 1+1?"}]
HISTORY = [{"role": "system", "content": "You are a helpful assistant."},
           {"role": "user", "content": "Who won the world series in 2020?"},
           {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
           {"role": "user", "content": "Where was it played?"}]
CHOICES = ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]
# vLLM's employee-profile schema, with bounds: a random model under the grammar would write strings and
# lists until max_tokens otherwise.
EMPLOYEE = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 3, "maxLength": 12},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "skills"], "additionalProperties": False}
IPV4 = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, **kw)


def test_no_logprobs_chat(client):
    out = _chat(client, messages=ASK, max_completion_tokens=5, temperature=0.0, logprobs=False)
    assert out.choices[0].logprobs is None


def test_zero_logprobs_chat(client):
    out = _chat(client, messages=ASK, max_completion_tokens=5, temperature=0.0, logprobs=True, top_logprobs=0)
    assert out.choices[0].logprobs.content is not None and len(out.choices[0].logprobs.content[0].top_logprobs) == 0


def test_some_logprobs_chat(client):
    out = _chat(client, messages=ASK, max_completion_tokens=5, temperature=0.0, logprobs=True, top_logprobs=5)
    assert len(out.choices[0].logprobs.content[0].top_logprobs) == 5


def test_too_many_chat_logprobs(client):
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        for _ in _chat(client, messages=ASK, max_completion_tokens=10, logprobs=True, top_logprobs=21, stream=True):
            pass
    with pytest.raises(openai.BadRequestError):
        _chat(client, messages=ASK, max_completion_tokens=10, logprobs=True, top_logprobs=30)
    out = _chat(client, messages=ASK, max_completion_tokens=10)
    assert out.choices[0].message.content is not None


@pytest.mark.parametrize("prompt_logprobs", [1, 0, -1, None])
def test_prompt_logprobs_chat(client, prompt_logprobs):
    kw: dict = {"messages": HISTORY}
    if prompt_logprobs is not None:
        kw["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):
            _chat(client, **kw)
        return
    out = _chat(client, **kw)
    if prompt_logprobs is None:
        assert getattr(out, "prompt_logprobs", None) is None
    else:
        assert len(out.prompt_logprobs) > 0


def test_more_than_one_prompt_logprobs_chat(client):
    """Top-k of a prompt position, plus the prompt's own token when it is not among them (vLLM's zephyr
    ranks that token first at position 3, so it sees exactly k; a random model need not)."""
    for k in (1, 2):
        out = _chat(client, messages=HISTORY, max_completion_tokens=5, extra_body={"prompt_logprobs": k})
        assert k <= len(out.prompt_logprobs[3]) <= k + 1


def test_single_chat_session(client, http):
    messages = list(ASK)
    out = _chat(client, messages=messages, max_completion_tokens=5, logprobs=True, top_logprobs=5)
    assert out.id and len(out.choices) == 1 and out.choices[0].finish_reason == "length"
    n_prompt = http.post("/tokenize", json={"messages": messages}).json()["count"]  # vLLM: zephyr's 37
    assert (out.usage.completion_tokens, out.usage.prompt_tokens, out.usage.total_tokens) == (5, n_prompt, n_prompt + 5)
    message = out.choices[0].message
    assert message.role == "assistant" and len(message.content) >= 1
    messages += [{"role": "assistant", "content": message.content}, {"role": "user", "content": "express your result in json"}]
    assert _chat(client, messages=messages, max_completion_tokens=5).choices[0].message.content is not None


def test_chat_streaming(client):
    whole = _chat(client, messages=ASK, max_completion_tokens=10, temperature=0.0)
    parts, finishes = [], 0
    for chunk in _chat(client, messages=ASK, max_completion_tokens=10, temperature=0.0, stream=True):
        delta = chunk.choices[0].delta
        assert delta.role in (None, "assistant")
        if delta.content:
            parts.append(delta.content)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == 1 and chunk.choices[0].finish_reason == whole.choices[0].finish_reason
    assert delta.content
    assert "".join(parts) == whole.choices[0].message.content


def test_chat_completion_stream_options(client):
    """min_characters is no request field of vLLM's nor stepahead's (both accept and ignore it): its check
    holds on the model's text alone."""
    kw = {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                       {"role": "user", "content": "What is the capital of France?"}],
          "max_completion_tokens": 10, "temperature": 0.0}
    assert all(c.usage is None for c in _chat(client, **kw, stream=True, stream_options={"include_usage": False}))
    chunks = list(_chat(client, **kw, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False}))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    u = chunks[-1].usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    for options in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(openai.BadRequestError):
            _chat(client, **kw, stream=False, stream_options=options)
    last = 0
    for chunk in _chat(client, **kw, extra_body={"min_tokens": 10}, stream=True,
                       stream_options={"include_usage": True, "continuous_usage_stats": True}):
        u = chunk.usage
        assert u.prompt_tokens >= 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert last == 0 or u.completion_tokens > last or (not chunk.choices and u.completion_tokens == last)
        last = u.completion_tokens
    assert last == 10
    text = "".join(c.choices[0].delta.content or "" for c in _chat(
        client, **kw, extra_body={"min_characters": 10}, stream=True, stream_options={"include_usage": False}))
    assert len(text) >= 10


def test_structured_outputs_choice_chat(client):
    messages = [ASK[0], {"role": "user", "content": "The best language for type-safe systems programming is "}]
    first = _chat(client, messages=messages, max_completion_tokens=10, temperature=0.7, seed=1,
                  extra_body={"structured_outputs": {"choice": CHOICES}}).choices[0].message.content
    assert first in CHOICES
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "I disagree, pick another one"}]
    second = _chat(client, messages=messages, max_completion_tokens=10, temperature=0.7, seed=2,
                   extra_body={"structured_outputs": {"choice": CHOICES}}).choices[0].message.content
    assert second in CHOICES and second != first


def test_structured_outputs_regex_chat(client):
    messages = [ASK[0], {"role": "user", "content": f"Give an example IP address with this regex: {IPV4}"}]
    first = _chat(client, messages=messages, max_completion_tokens=20, seed=1,
                  extra_body={"structured_outputs": {"regex": IPV4}}).choices[0].message.content
    assert re.fullmatch(IPV4, first)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Give me a different one"}]
    second = _chat(client, messages=messages, max_completion_tokens=20, seed=2,
                   extra_body={"structured_outputs": {"regex": IPV4}}).choices[0].message.content
    assert re.fullmatch(IPV4, second) and second != first


def test_structured_outputs_type_error(client):
    with pytest.raises(openai.BadRequestError):
        _chat(client, messages=ASK, extra_body={"structured_outputs": {"regex": {1: "Python", 2: "C++"}}})


def test_structured_outputs_choice_chat_logprobs(client):
    out = _chat(client, messages=ASK, max_completion_tokens=10, logprobs=True, top_logprobs=5,
                extra_body={"structured_outputs": {"choice": CHOICES}})
    for item in out.choices[0].logprobs.content[0].top_logprobs:
        assert item.logprob >= -9999.0  # OpenAI's floor: masked tokens never show -inf


def test_response_format_json_object(client):
    """vLLM's model writes {"result": 2}; the port asks the same and checks that a JSON object came back."""
    for seed in (1, 2):
        out = _chat(client, messages=[{"role": "user", "content": 'what is 1+1? the format is {"result": 2}'}],
                    response_format={"type": "json_object"}, seed=seed)
        assert out.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_response_format_json_schema(client):
    prompt = [{"role": "user", "content": 'what is 1+1? The format is "result": 2'}]
    schema = {"type": "object", "properties": {"result": {"type": "integer"}}, "required": ["result"],
              "additionalProperties": False}
    for seed in (1, 2):
        free = _chat(client, messages=prompt, max_completion_tokens=20, seed=seed).choices[0].message.content
        with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(free), schema)
        out = _chat(client, messages=prompt, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "foo_test", "schema": schema}})
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_response_format_text(client):
    for _ in range(2):
        out = _chat(client, messages=[{"role": "user", "content": "what is 1+1?"}], max_completion_tokens=10,
                    response_format={"type": "text"})
        assert out.choices[0].message.content is not None


def test_extra_fields_allowed(client):
    out = _chat(client, messages=[{"role": "user", "content": "what is 1+1?", "extra_field": "0"}],
                max_completion_tokens=10, temperature=0, seed=0)
    assert out.choices[0].message.content is not None


def test_complex_message_content(client):
    """A list of text parts is the same prompt as the string (vLLM checks its model's answer, "2")."""
    text = "what is 1+1? please provide the result without any other text."
    parts = _chat(client, messages=[{"role": "user", "content": [{"type": "text", "text": text}]}],
                  max_completion_tokens=10, temperature=0, seed=0)
    plain = _chat(client, messages=[{"role": "user", "content": text}], max_completion_tokens=10, temperature=0, seed=0)
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_custom_role(client):
    outs = [_chat(client, messages=[{"role": "my-custom-role", "content": content}], max_completion_tokens=10,
                  temperature=0, seed=0).choices[0].message.content
            for content in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}])]
    assert outs[0] == outs[1]


def test_long_seed(client):
    for seed in (-(2**63) - 1, 2**63):
        with pytest.raises(openai.BadRequestError) as err:
            _chat(client, messages=[{"role": "system", "content": "You are a helpful assistant."}], temperature=0,
                  seed=seed)
        assert "greater_than_equal" in err.value.message or "less_than_equal" in err.value.message


def test_invocations(http):
    """The same body to /v1/chat/completions and /invocations, both read raw (vLLM dumps the client's
    model, which adds the fields OpenAI's type declares; its server sends them, null)."""
    body = {"model": MODEL, "messages": ASK, "max_completion_tokens": 5, "temperature": 0.0, "logprobs": False}
    chat, invoked = (http.post(path, json=body) for path in ("/v1/chat/completions", "/invocations"))
    assert chat.status_code == invoked.status_code == 200, invoked.text
    assert chat.json().keys() == invoked.json().keys()
    assert chat.json()["choices"] == invoked.json()["choices"]


def test_chat_completion_n_parameter_non_streaming(client):
    out = _chat(client, messages=[{"role": "user", "content": "What is the opposite of big?"}],
                max_completion_tokens=20, temperature=0.7, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content for c in out.choices)
    assert len({c.message.content for c in out.choices}) > 1


def test_chat_completion_n_parameter_streaming(client):
    parts: dict[int, list[str]] = defaultdict(list)
    for chunk in _chat(client, messages=[{"role": "user", "content": "What is the capital of France?"}],
                       max_completion_tokens=15, temperature=0.7, n=2, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                parts[choice.index].append(choice.delta.content)
    assert "".join(parts[0]) and "".join(parts[1])


def test_chat_completion_n_with_seed(client):
    out = _chat(client, messages=[{"role": "user", "content": "Say hello."}], max_completion_tokens=10,
                temperature=0.8, n=2, seed=42)
    assert [c.index for c in out.choices] == [0, 1] and all(c.message.content for c in out.choices)


def test_chat_completion_n_equals_1(client):
    out = _chat(client, messages=[{"role": "user", "content": "Hello!"}], max_completion_tokens=10, temperature=0.7, n=1)
    assert len(out.choices) == 1 and out.choices[0].index == 0 and out.choices[0].message.content is not None
