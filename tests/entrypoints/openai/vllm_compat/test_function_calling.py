"""vLLM's chat_completion/test_completion_with_function_calling.py against `stepahead serve
--tool-call-parser hermes` on the built-in SmolLM2-135M-Instruct (a real model, as vLLM's Qwen3-0.6B: under
a JSON grammar the random tiny model writes whitespace until max_tokens, the grammar allowing it).

Applies: "required" and named tool choices (the calls are constrained by the tools' schemas, so any model
makes them), the no-argument round trip, named calls streamed and not, the refusals, and max_tokens cutting
a required call. Not ported: tool_choice "auto" with vLLM's Qwen3 (whether a model decides to call is its
own) and enable_thinking (Qwen3's reasoning text). The strings of vLLM's tools get a maxLength: under the
grammar a random model would write a string until max_tokens."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.entrypoints.openai.vllm_compat.conftest import REAL_MODEL as MODEL

CITY = {"type": "string", "description": "The city to find the weather for, e.g. 'Vienna'", "maxLength": 12}
COUNTRY = {"type": "string", "description": "The country that the city is in, e.g. 'Austria'", "maxLength": 12}
UNIT = {"type": "string", "description": "The unit to fetch the temperature in", "enum": ["celsius", "fahrenheit"]}
OPTIONS = {"title": "WeatherOptions", "type": "object", "additionalProperties": False, "properties": {
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
    "include_forecast": {"type": "boolean", "default": False},
    "language": {"type": "string", "default": "zh-CN", "enum": ["zh-CN", "en-US", "ja-JP"]}}}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_current_weather", "description": "Get the current weather in a given location",
        "parameters": {"type": "object", "properties": {
            "city": CITY, "country": COUNTRY, "unit": UNIT,
            "options": {"$ref": "#/$defs/WeatherOptions", "description": "Optional parameters for weather query"}},
            "required": ["country", "unit"], "$defs": {"WeatherOptions": OPTIONS}}}},
    {"type": "function", "function": {
        "name": "get_forecast", "description": "Get the weather forecast for a given location",
        "parameters": {"type": "object", "properties": {
            "city": CITY, "country": COUNTRY, "days": {"type": "integer", "minimum": 1, "maximum": 7}, "unit": UNIT},
            "required": ["country", "days", "unit"]}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "Hi! How are you doing today?"},
            {"role": "assistant", "content": "I'm doing well! How can I help you?"},
            {"role": "user", "content": "Can you tell me what the current weather is in Berlin and the forecast for "
                                        "the next 5 days, in fahrenheit?"}]
NAMED = {"type": "function", "function": {"name": "get_current_weather"}}
EMPLOYEE = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 3, "maxLength": 12}, "age": {"type": "integer", "minimum": 18, "maximum": 99}},
    "required": ["name", "age"], "additionalProperties": False}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client(real_client):
    return real_client


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
@pytest.mark.parametrize("stream", [True, False])
def test_function_tool_use(client, stream, tool_choice):
    kw = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "temperature": 0.0,
          "extra_body": NO_THINKING}
    if not stream:
        calls = client.chat.completions.create(**kw).choices[0].message.tool_calls
        assert calls
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        return
    deltas = [d for chunk in client.chat.completions.create(**kw, stream=True) if chunk.choices
              for d in chunk.choices[0].delta.tool_calls or []]
    assert deltas


@pytest.mark.parametrize("arguments", ["{}", ""])
def test_no_args_tool_call(client, arguments):
    tools = [{"type": "function", "function": {
        "name": "get_current_time", "description": "Get the current date and time. No parameters needed.",
        "parameters": {"type": "object", "properties": {}, "required": []}}}]
    messages: list = [{"role": "system", "content": "You are a helpful assistant. Always use the available tools."},
                      {"role": "user", "content": "What time is it now?"}]
    shared = {"model": MODEL, "temperature": 0.0, "seed": 42, "extra_body": NO_THINKING}
    message = client.chat.completions.create(**shared, messages=messages, tools=tools, tool_choice="auto",
                                             max_completion_tokens=64).choices[0].message
    if not message.tool_calls:
        assert message.content is not None
        return
    call = message.tool_calls[0]
    assert call.function.name == "get_current_time"
    call.function.arguments = arguments
    messages += [message, {"role": "tool", "tool_call_id": call.id, "content": "2025-01-01T00:00:00"}]
    final = client.chat.completions.create(**shared, messages=messages, max_completion_tokens=128)
    assert final.choices[0].message.content.strip()


def test_named_tool_use(client):
    """max_completion_tokens 400 for vLLM's 1000: the server's context is 1024 tokens."""
    tools = [{"type": "function", "function": {"name": "dummy_function_name", "description": "This is a dummy function",
                                               "parameters": EMPLOYEE}}]
    choice = {"type": "function", "function": {"name": "dummy_function_name"}}
    messages: list = [{"role": "system", "content": "you are a helpful assistant"},
                      {"role": "user", "content": "Give an example JSON for an employee profile using the specified tool."}]
    message = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=400, tools=tools,
                                             temperature=0.0, tool_choice=choice).choices[0].message
    assert not message.content  # vLLM sends "", stepahead null (OpenAI's form for a call alone)
    first = json.loads(message.tool_calls[0].function.arguments)
    jsonschema.validate(first, EMPLOYEE)
    messages += [{"role": "assistant", "content": json.dumps(first)},
                 {"role": "user", "content": "Give me another one with a different name and age"}]
    parts, finishes = [], 0
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=400, tools=tools,
                                                tool_choice=choice, temperature=0.0, stream=True):
        delta = chunk.choices[0].delta
        assert delta.role in (None, "assistant") and not delta.content
        if delta.tool_calls and delta.tool_calls[0].function.arguments:
            parts.append(delta.tool_calls[0].function.arguments)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == 1
    second = json.loads("".join(parts))
    jsonschema.validate(second, EMPLOYEE)
    assert (first["name"], first["age"]) != (second["name"], second["age"])


def test_inconsistent_tool_choice_and_tools(client):
    tool = [{"type": "function", "function": {"name": "dummy_function_name", "parameters": EMPLOYEE}}]
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "An employee profile"}], "max_completion_tokens": 1000}
    for extra in ({"tool_choice": {"type": "function", "function": {"name": "dummy_function_name"}}},
                  {"tools": tool, "tool_choice": {"type": "function", "function": {"name": "nondefined_function_name"}}},
                  {"tools": tool, "tool_choice": {}}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**kw, **extra)


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_max_tokens_with_tool_choice_required(client, tool_choice):
    model = client.models.list().data[0].id
    choice = client.chat.completions.create(messages=MESSAGES, temperature=0, max_completion_tokens=1, model=model,
                                            tools=TOOLS, tool_choice=tool_choice).choices[0]
    # the call was cut before it was whole: no call is reported (vLLM answers null, stepahead an empty
    # list, the form its content-only answers have)
    assert choice.finish_reason == "length" and not choice.message.tool_calls
