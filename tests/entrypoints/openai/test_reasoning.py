"""--reasoning-parser through the openai client against `stepahead serve` on the built-in model, which
never ends its reasoning: a grammar waits for that end, so it leaves the reasoning alone, and a prompt
that closes the reasoning is constrained from its first token. The split of reasoning, content and tool
calls on a model that does end its reasoning is in tests/structured_output/test_grammar_after_reasoning.py."""

from __future__ import annotations

import openai
import pytest

from stepahead.models.loading.loader import builtin_model_path
from tests.entrypoints.openai.server_utils import RemoteServer

ASK = [{"role": "user", "content": "Hi!"}]
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                     "<think>\n\n</think>\n\n{% endif %}")


@pytest.fixture(scope="module")
def client():
    server = RemoteServer(builtin_model_path(), "--served-model-name", "x", "--max-model-len", "1024",
                          "--executor", "uni", "--reasoning-parser", "deepseek_r1", "--trust-request-chat-template")
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    server.stop()


def _scripted(text: str) -> dict:
    return {"structured_outputs": {"choice": [text]}}


def test_a_grammar_waits_for_the_reasoning(client):
    """The model thinks freely under response_format: its reasoning is exactly the unconstrained output's
    (this model never closes it, so nothing follows it and the grammar never applies)."""
    kw = dict(model="x", messages=ASK, temperature=0, max_tokens=16)
    free = client.chat.completions.create(**kw).choices[0]
    constrained = client.chat.completions.create(**kw, response_format={"type": "json_object"}).choices[0]
    assert constrained.message.reasoning_content == free.message.reasoning_content
    assert constrained.finish_reason == free.finish_reason and not constrained.message.content


def test_a_prompt_that_closes_the_reasoning_is_constrained_from_the_start(client):
    r = client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=16, extra_body={
        "chat_template": THINKING_TEMPLATE, "chat_template_kwargs": {"enable_thinking": False},
        "structured_outputs": {"choice": ["No thoughts."]}})
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == (None, "No thoughts.")


def test_enable_thinking_reaches_the_template(client):
    def prompt_tokens(kwargs: dict) -> int:
        r = client.chat.completions.create(model="x", messages=ASK, max_tokens=1, extra_body={
            "chat_template": THINKING_TEMPLATE, "chat_template_kwargs": kwargs})
        return r.usage.prompt_tokens
    assert prompt_tokens({"enable_thinking": False}) > prompt_tokens({"enable_thinking": True})


def test_include_reasoning_false_leaves_the_reasoning_out(client):
    """This model's whole output is reasoning: with include_reasoning false, neither the message nor the
    stream's deltas carry it."""
    kw = dict(model="x", messages=ASK, temperature=0, max_tokens=8)
    shown = client.chat.completions.create(**kw).choices[0].message
    hidden = client.chat.completions.create(**kw, extra_body={"include_reasoning": False}).choices[0].message
    assert shown.reasoning_content and not shown.content
    assert hidden.reasoning_content is None and not hidden.content
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={"include_reasoning": False}))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not [c for c in chunks if getattr(c.choices[0].delta, "reasoning_content", None)]
