"""--reasoning-parser through the openai client against `stepahead serve` on the built-in model. The
model's output is scripted with a structured_outputs choice (the real engine generates it under that
grammar); its reasoning and content come back apart, streamed too, and tool calls are read after it."""

from __future__ import annotations

import json

import openai
import pytest

from stepahead.models.loading.loader import builtin_model_path
from tests.entrypoints.openai.server_utils import RemoteServer

ASK = [{"role": "user", "content": "Hi!"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}]
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                     "<think>\n\n</think>\n\n{% endif %}")


@pytest.fixture(scope="module")
def client():
    server = RemoteServer(builtin_model_path(), "--served-model-name", "x", "--max-model-len", "1024",
                          "--executor", "uni", "--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes", "--trust-request-chat-template")
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    server.stop()


def _scripted(text: str) -> dict:
    return {"structured_outputs": {"choice": [text]}}


def test_reasoning_and_content_apart_streamed_too(client):
    script = _scripted("The user greets me; greet back.</think>Hello there!")
    r = client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=64, extra_body=script)
    message = r.choices[0].message
    assert message.reasoning_content == "The user greets me; greet back." and message.content == "Hello there!"
    reasoning, content, chunks = "", "", 0
    for chunk in client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=64, stream=True,
                                                extra_body=script):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        chunks += 1
    assert (reasoning, content) == (message.reasoning_content, message.content) and chunks > 3


def test_tool_calls_are_read_after_the_reasoning(client):
    script = _scripted('Weather needs a tool.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                       "</tool_call>")
    r = client.chat.completions.create(model="x", messages=ASK, tools=TOOLS, temperature=0, max_tokens=96,
                                       extra_body=script)
    choice = r.choices[0]
    assert choice.message.reasoning_content == "Weather needs a tool." and choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Oslo"})]


def test_output_constrained_to_json_is_all_content(client):
    r = client.chat.completions.create(model="x", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
                                       parallel_tool_calls=False, max_tokens=200)
    choice = r.choices[0]
    assert choice.message.reasoning_content is None and choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    r = client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=32,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.reasoning_content is None and r.choices[0].message.content.lstrip().startswith("{")


def test_enable_thinking_reaches_the_template(client):
    def prompt_tokens(kwargs: dict) -> int:
        r = client.chat.completions.create(model="x", messages=ASK, max_tokens=1, extra_body={
            "chat_template": THINKING_TEMPLATE, "chat_template_kwargs": kwargs})
        return r.usage.prompt_tokens
    assert prompt_tokens({"enable_thinking": False}) > prompt_tokens({"enable_thinking": True})
