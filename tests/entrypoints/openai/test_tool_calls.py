"""Tool calling through the official openai client against `stepahead serve` on the built-in model.

"required" and named calls are constrained by the functions' schemas, so every one of N tries parses and
validates. The "auto" round trip scripts the model's output with a structured_outputs choice (the real
engine generates it token by token under that grammar) and reads it back with the hermes parser."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from stepahead.models.loading.loader import builtin_model_path
from tests.entrypoints.openai.server_utils import RemoteServer

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# N tries: greedy over N questions (sampling at temperature 1 lets a 135M model pad the JSON with whitespace
# past any max_tokens, and greedy decoding of some questions repeats the same call until max_tokens: the
# grammar guarantees the form, not the length).
QUESTIONS = ["What is the weather in Paris?", "What time is it in Tokyo?", "Is it raining in Oslo?",
             "What is the time in Berlin?", "Should I take an umbrella in London?", "Weather and time in Rome?",
             "How hot is it in Cairo in fahrenheit?", "Hello!"]
SCRIPTED = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>')


@pytest.fixture(scope="module")
def client():
    server = RemoteServer(builtin_model_path(), "--served-model-name", "x", "--max-model-len", "1024",
                          "--executor", "uni", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    server.stop()


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_always_parse_and_validate(client):
    """One call each (parallel_tool_calls false: the array closes after it, so every output ends): 100%."""
    for question in QUESTIONS:
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": question}],
                                           tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                           temperature=0, max_tokens=400)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)


def test_parallel_required_calls_validate_even_when_cut(client):
    """Several calls allowed: a small model may repeat calls until max_tokens; the calls it completed are
    returned and validate, and a complete output is finish_reason "tool_calls"."""
    for question in QUESTIONS:
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": question}],
                                           tools=TOOLS, tool_choice="required", temperature=0, max_tokens=400)
        choice = r.choices[0]
        assert choice.finish_reason in ("tool_calls", "length"), choice
        _check_calls(choice.message.tool_calls)


def test_named_function(client):
    for question in QUESTIONS:
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": question}],
                                           tools=TOOLS, temperature=0, max_tokens=400,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop"  # OpenAI's and vLLM's answer for a named function
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
        _check_calls(choice.message.tool_calls)


def _streamed_calls(stream) -> tuple[str, dict[int, dict], list[str]]:
    content, calls, finishes = "", {}, []
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id is not None:
                assert call["id"] is None and delta.function.name  # id and name first, once
                call.update(id=delta.id, name=delta.function.name)
            else:
                assert call["id"] is not None
            call["arguments"] += delta.function.arguments or ""
        if choice.finish_reason is not None:
            finishes.append(choice.finish_reason)
    return content, calls, finishes


def test_required_calls_stream_as_deltas(client):
    kw = dict(model="x", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=400)
    full = client.chat.completions.create(**kw).choices[0].message.tool_calls
    _, calls, finishes = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert finishes == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in full]


def test_auto_round_trip_with_the_hermes_parser(client):
    script = {"structured_outputs": {"choice": [SCRIPTED]}}
    r = client.chat.completions.create(model="x", messages=ASK, tools=TOOLS, temperature=0, max_tokens=200,
                                       extra_body=script)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}

    content, calls, finishes = _streamed_calls(client.chat.completions.create(
        model="x", messages=ASK, tools=TOOLS, temperature=0, max_tokens=200, stream=True, extra_body=script))
    assert content == "Checking." and finishes == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"})]

    # The next turn: the assistant's call and the tool's answer go back through the template.
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model="x", messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=8, extra_body={"structured_outputs": {"choice": ["It is 21."]}})
    assert answer.choices[0].message.content == "It is 21." and answer.choices[0].message.tool_calls == []
    assert answer.choices[0].finish_reason == "stop"


def test_tool_choice_none_answers_in_text(client):
    r = client.chat.completions.create(model="x", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=5)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls == []


@pytest.mark.parametrize("kw, param", [
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "absent"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400s(client, kw, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="x", messages=ASK, max_tokens=4, **kw)
    assert raised.value.body["param"] == param


# -- the Responses API's function tools, on the same server ------------------------------------------------

RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}
NAMED_RESPONSE_TOOL = {"type": "function", "name": "get_weather"}


def test_responses_function_call_then_its_output(client):
    r = client.responses.create(model="x", input="What is the weather in Paris?", tools=[RESPONSES_TOOL],
                                tool_choice=NAMED_RESPONSE_TOOL, max_output_tokens=200, temperature=0)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow = client.responses.create(model="x", previous_response_id=r.id, max_output_tokens=8, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny, 21 degrees"}])
    chat = client.chat.completions.create(model="x", temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 degrees"}])
    assert follow.previous_response_id == r.id
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.output_text == chat.choices[0].message.content


def test_responses_function_call_streamed(client):
    kw = dict(model="x", input="Is it raining in Oslo?", tools=[RESPONSES_TOOL], tool_choice=NAMED_RESPONSE_TOOL,
              max_output_tokens=200, temperature=0)
    (whole,) = [item for item in client.responses.create(**kw).output if item.type == "function_call"]
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types.index("response.output_item.added") < types.index("response.function_call_arguments.delta")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done.arguments == whole.arguments
    (call,) = [item for item in events[-1].response.output if item.type == "function_call"]
    assert call.name == whole.name == "get_weather" and call.arguments == whole.arguments
