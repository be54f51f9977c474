"""vLLM's chat_completion/test_chat_logit_bias_validation.py and test_chat_stop_token_ids_validation.py:
token ids outside the vocabulary are 400s that name the id and the vocabulary size."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.vllm_compat.conftest import MODEL
from tests.tiny_models import VOCAB_SIZE


def _chat(client, content: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=5, **kw)


def _refused(client, **kw) -> str:
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, "Testing", **kw)
    assert err.value.status_code == 400
    return str(err.value)


def test_chat_logit_bias_valid(client):
    assert _chat(client, "Testing valid logit bias", logit_bias={str(VOCAB_SIZE - 1): 1.0}).choices[0].message.content is not None


def test_chat_logit_bias_invalid(client):
    message = _refused(client, logit_bias={str(VOCAB_SIZE + 1): 1.0})
    assert str(VOCAB_SIZE + 1) in message and str(VOCAB_SIZE) in message


def test_chat_logit_bias_non_integer_key(client):
    message = _refused(client, logit_bias={"not_a_token_id": 50})
    assert "not_a_token_id" in message and "logit_bias" in message


def test_chat_logit_bias_non_numeric_value(client):
    assert "logit_bias" in _refused(client, logit_bias={"1": "not_a_number"})


def test_chat_logit_bias_multiple_non_integer_keys(client):
    message = _refused(client, logit_bias={"bad1": 50.0, "bad2": 20.0})
    assert "bad1" in message and "bad2" in message


def test_chat_stop_token_ids_valid(client):
    out = _chat(client, "Testing valid stop token ids", extra_body={"stop_token_ids": [VOCAB_SIZE - 1]})
    assert out.choices[0].message.content is not None


def test_chat_stop_token_ids_out_of_vocab(client):
    message = _refused(client, extra_body={"stop_token_ids": [VOCAB_SIZE + 1]})
    assert str(VOCAB_SIZE + 1) in message and str(VOCAB_SIZE) in message


def test_chat_stop_token_ids_negative(client):
    _refused(client, extra_body={"stop_token_ids": [-1]})
