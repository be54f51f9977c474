"""vLLM's chat_completion/test_chat_echo.py against the folder's `stepahead serve` whose --max-logprobs
lifts the cap (vLLM sets it to its model's vocabulary), so -1 logprobs (the whole vocabulary) are allowed."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.vllm_compat.conftest import MODEL
from tests.tiny_models import VOCAB_SIZE

QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Beijing is the capital of which country?"}]


@pytest.fixture(scope="module")
def client(flags_client):
    return flags_client


@pytest.mark.parametrize("echo", [True, False])
def test_chat_session_with_echo_and_continue_final_message(client, echo):
    """vLLM's model ends the saying (finish_reason "stop"); the tiny one is cut by max_tokens. What is
    checked is where the assistant's unfinished message goes: before the output with echo, nowhere without."""
    saying = "Here is a common saying about apple. An apple a day, keeps"
    out = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0.0,
        messages=[{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": saying}],
        extra_body={"echo": echo, "continue_final_message": True, "add_generation_prompt": False})
    assert out.id and len(out.choices) == 1 and out.choices[0].finish_reason in ("stop", "length")
    message = out.choices[0].message
    assert message.role == "assistant" and message.content is not None
    assert message.content.startswith(saying) if echo else saying not in message.content


def test_prompt_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, extra_body={"prompt_logprobs": -1})
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) > 0
    assert all(len(entry) >= VOCAB_SIZE for entry in out.prompt_logprobs[1:])


def test_top_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1,
                                         extra_body={"top_logprobs": -1, "logprobs": "true"})
    content = out.choices[0].logprobs.content
    assert len(content) > 0 and len(content[0].top_logprobs) == VOCAB_SIZE
