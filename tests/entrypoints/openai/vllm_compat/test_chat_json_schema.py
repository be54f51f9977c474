"""vLLM's chat_completion/test_chat.py, its JSON-schema case, on the folder's real-model server: under a
JSON grammar the random tiny model writes whitespace until max_tokens (the grammar allows it), where vLLM's
zephyr and SmolLM2 write the object and stop."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.entrypoints.openai.vllm_compat.conftest import REAL_MODEL as MODEL
from tests.entrypoints.openai.vllm_compat.test_chat import ASK, EMPLOYEE


@pytest.fixture(scope="module")
def client(real_client):
    return real_client


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, **kw)


def test_structured_outputs_json_chat(client):
    """max_completion_tokens 300 for vLLM's 1000 (the object is a few dozen tokens)."""
    messages = [ASK[0], {"role": "user", "content": f"Give an example JSON for an employee profile: {EMPLOYEE}"}]
    first = json.loads(_chat(client, messages=messages, max_completion_tokens=300, seed=1,
                             extra_body={"structured_outputs": {"json": EMPLOYEE}}).choices[0].message.content)
    jsonschema.validate(first, EMPLOYEE)
    messages += [{"role": "assistant", "content": json.dumps(first)},
                 {"role": "user", "content": "Give me another one with a different name and age"}]
    second = json.loads(_chat(client, messages=messages, max_completion_tokens=300, seed=2,
                              extra_body={"structured_outputs": {"json": EMPLOYEE}}).choices[0].message.content)
    jsonschema.validate(second, EMPLOYEE)
    assert (first["name"], first["age"]) != (second["name"], second["age"])
