"""Every bad input gets its status and an OpenAI-shaped error body, and the server keeps serving."""

from __future__ import annotations

import json

import openai
import pytest

from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.tiny_models import VOCAB_SIZE

P = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
M = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

BAD_COMPLETIONS = [
    # (body overrides, expected param or None, a phrase the message must contain)
    ({"temperature": -1}, "temperature", "temperature"),
    ({"top_p": 0}, "top_p", "top_p"),
    ({"top_p": 1.5}, "top_p", "top_p"),
    ({"top_k": 1.5}, "top_k", "top_k"),
    ({"top_k": -2}, "top_k", "top_k"),
    ({"min_p": 2}, "min_p", "min_p"),
    ({"n": 0}, "n", "n must be"),
    ({"n": 1000}, "n", "n must be"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"max_tokens": -5}, "max_tokens", "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "min_tokens"),
    ({"logprobs": 21}, "logprobs", "logprobs"),
    ({"logprobs": -1}, "logprobs", "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty"),
    ({"stop": [""]}, "stop", "stop"),
    ({"stop_token_ids": [VOCAB_SIZE + 5]}, "stop_token_ids", "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "stop_token_ids"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [[]]}, "prompt", "empty"),
    ({"prompt": [VOCAB_SIZE + 1]}, "prompt_token_ids", str(VOCAB_SIZE)),
    ({"prompt": [-3]}, "prompt_token_ids", str(VOCAB_SIZE)),
    ({"prompt": 123}, "prompt", ""),
    ({"prompt": [5] * 600}, None, "maximum context length is 512 tokens"),
    ({"prompt": [5] * 500, "max_tokens": 100}, None, "maximum context length is 512 tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"suffix": "x"}, "suffix", "suffix"),
    ({"logit_bias": {str(VOCAB_SIZE): 1.0}}, "logit_bias", f"logit_bias must be token ids in [0, {VOCAB_SIZE})"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "less than or equal to 100"),
    ({"allowed_token_ids": [VOCAB_SIZE]}, "allowed_token_ids", "allowed_token_ids must be token ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "must not be empty"),
    # vLLM and OpenAI fields not implemented: refused by name rather than ignored.
    ({"use_beam_search": True}, "use_beam_search", "use_beam_search"),
    ({"length_penalty": 2.0}, "length_penalty", "beam search"),
    ({"logits_processors": ["my.Processor"]}, "logits_processors", "logits_processors"),
    ({"thinking_token_budget": 64}, "thinking_token_budget", "thinking_token_budget"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "predicted outputs"),
    ({"priority": 3}, "priority", "--scheduling-policy priority"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be at most 20"),
    ({"prompt_logprobs": -2}, "prompt_logprobs", "prompt_logprobs must be -1 (the whole vocabulary) or >= 0"),
    ({"logprobs": -1}, "logprobs", "logprobs must be at most 20, the engine's max_logprobs; -1 asks for the whole vocabulary, 2048 tokens"),
    ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": "x"}}, "stream_options", ""),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when `stream=True`"),
    ({"max_tokens": 0}, "max_tokens", "0 only with echo"),
    ({"bad_words": [""]}, "bad_words", "bad_words must be non-empty strings"),
    ({"bad_words": ["w" * 4000] * 1000}, "bad_words", "bad_words"),
    ({"echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs", "logprobs must be at most 20"),
    ({"prompt_embeds": "abc"}, "prompt_embeds", "prompt_embeds"),
    ({"truncate_prompt_tokens": 600}, "truncate_prompt_tokens", "at most the context length 512"),
    ({"truncation_side": "middle"}, "truncation_side", ""),
    ({"best_of": 2}, "best_of", "best_of"),
    ({"seed": 2**64}, "seed", ""),
    ({"response_format": {"type": "bogus"}}, "response_format", ""),
    # One check in the input processor, shared with the offline LLM; the param is the field the client sent.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", 'invalid JSON schema in structured_outputs: Unsupported type "bogus"'),
    ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs", "invalid regex in structured_outputs"),
    ({"guided_grammar": "root ::= "}, "structured_outputs", "invalid grammar in structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"stream": "maybe"}, "stream", ""),
    # Strict numbers: OpenAI's ranges, integers in bounds, booleans are not token ids.
    ({"temperature": 1e308}, "temperature", "less than or equal to 2"),
    ({"temperature": 2.5}, "temperature", "temperature"),
    ({"top_k": 1e20}, "top_k", "integer"),
    ({"top_k": 10**20}, "top_k", "top_k"),
    ({"max_tokens": 2**40}, "max_tokens", "max_tokens"),
    ({"n": True}, "n", ""),
    ({"prompt": [True, False]}, "prompt", ""),
    ({"prompt": [[False]]}, "prompt", ""),
    ({"stop_token_ids": [True]}, "stop_token_ids", ""),
]


def _check_error(r, status: int, param: str | None = None, phrase: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert phrase.lower() in err["message"].lower(), err
    return err


def _ok(http) -> None:
    r = http.post("/v1/completions", json=P)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("override,param,phrase", BAD_COMPLETIONS,
                         ids=[str(sorted(o))[:40] for o, _, _ in BAD_COMPLETIONS])
def test_bad_completion_request(http, override, param, phrase):
    r = http.post("/v1/completions", json={**P, **override})
    _check_error(r, 400, param, phrase)
    _ok(http)


def test_wording_of_odd_inputs(http):
    r = http.post("/v1/completions", content=b'{"prompt": "\\ud800 lone"}',
                  headers={"content-type": "application/json"})
    _check_error(r, 400, "prompt", "lone surrogate")
    r = http.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert _check_error(r, 400)["param"] is None  # not the character offset of the JSON error
    r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                                                "chat_template_kwargs": {"tokenize": True}})
    _check_error(r, 400, "chat_template_kwargs", "may not set ['tokenize']")
    _ok(http)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused(http, number):
    body = json.dumps({**P, "temperature": 0.5}).replace("0.5", number)
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    _check_error(r, 400, "temperature", "finite")
    _ok(http)


@pytest.mark.parametrize("override,param,phrase", [
    ({"messages": []}, "messages", ""),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "text"),
    ({"messages": [{"content": "no role"}]}, "messages", ""),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]},
     "tools", "unique"),
    ({"tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "`tools` must be set"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be at most 20"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "the whole vocabulary"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs", "not available when `stream=True`"),
    ({"use_beam_search": True}, "use_beam_search", "use_beam_search"),
    ({"thinking_token_budget": 64}, "thinking_token_budget", "reasoning tokens"),
    ({"priority": -1}, "priority", "--scheduling-policy priority"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", ""),
    ({"logit_bias": {"-1": 5}}, "logit_bias", "keys must be token ids"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message", ""),
    ({"max_completion_tokens": 0}, "max_tokens", "max_tokens"),
    ({"max_completion_tokens": 600}, None, "maximum context length is 512 tokens"),
    ({"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids", "stop_token_ids"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "response_format.json_schema.schema is required"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"guided_json": {"type": "object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs", "one of"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}}, "response_format",
     "invalid structural tag in structured_outputs: Invalid structural tag error: Format type not recognized"),
    ({"structural_tag": "{"}, "structural_tag", "invalid structural tag in structured_outputs: not JSON"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, "structured_outputs",
     "disable_any_whitespace applies to json and json_object only"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": " "}}, "structured_outputs",
     "whitespace_pattern is not supported by the xgrammar backend"),
])
def test_bad_chat_request(http, override, param, phrase):
    r = http.post("/v1/chat/completions", json={**M, **override})
    _check_error(r, 400, param, phrase)
    _ok(http)


def test_malformed_bodies_are_400_not_422(http):
    r = http.post("/v1/completions", content=b'{"prompt": "x", "temperature": NaN}',
                  headers={"content-type": "application/json"})
    _check_error(r, 400)
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    _check_error(r, 400)
    r = http.post("/v1/completions", content=b"prompt=hello", headers={"content-type": "text/plain"})
    _check_error(r, 400, phrase="application/json")
    r = http.post("/v1/completions", json={"max_tokens": 3})
    _check_error(r, 400, "prompt")
    r = http.post("/v1/chat/completions", json=[1, 2])
    _check_error(r, 400)
    _ok(http)


def test_unknown_model_is_404(http, client):
    err = _check_error(http.post("/v1/completions", json={**P, "model": "nope"}), 404, "model", "`nope`")
    assert err["type"] == "NotFoundError"
    _check_error(http.post("/v1/chat/completions", json={**M, "model": "nope"}), 404, "model")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    _check_error(http.get("/v1/no-such-route"), 404)


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1, logprobs=30)
    assert "logprobs" in str(exc.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1, stream=False,
                                  stream_options={"include_usage": True})
    assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1).choices[0].text is not None


def test_unknown_fields_are_accepted_and_logged_once(http, server):
    for _ in range(2):
        r = http.post("/v1/completions", json={**P, "frobnicate_level": 3})
        assert r.status_code == 200, r.text
    lines = [line for line in server.lines if "frobnicate_level" in line]
    assert len(lines) == 1 and "ignored" in lines[0]


def test_tokenize_and_detokenize_errors(http):
    _check_error(http.post("/tokenize", json={}), 400, "prompt")
    _check_error(http.post("/detokenize", json={"tokens": [VOCAB_SIZE]}), 400, "tokens")
    _check_error(http.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")
    _check_error(http.post("/tokenize", json={"prompt": "x", "model": "nope"}), 404, "model")


def test_accepted_variants(http):
    """Values at the edges of the allowed ranges, and no-op options, are accepted."""
    for override in ({"response_format": {"type": "text"}}, {"top_k": -1}, {"temperature": 0}, {"top_p": 1.0},
                     {"logprobs": 20}, {"stop": "x"}, {"seed": -1}, {"user": "u1"}, {"n": 2, "best_of": 2},
                     {"min_tokens": 2}, {"max_tokens": None, "prompt": [5] * 505},
                     {"prompt_logprobs": None, "use_beam_search": False, "return_token_ids": False,
                      "return_tokens_as_token_ids": False}, {"logit_bias": {}}, {"logit_bias": {"5": -100}},
                     {"prompt_logprobs": 20}, {"echo": True, "logprobs": 0, "max_tokens": 0},
                     {"bad_words": ["hello", "two words"]},
                     {"length_penalty": 1.0, "priority": 0, "spaces_between_special_tokens": False}):
        r = http.post("/v1/completions", json={**P, **override})
        assert r.status_code == 200, (override, r.text)
