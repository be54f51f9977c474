"""/v1/responses with the openai client's responses.create, streamed and not, against a real server:
the same output and usage as the chat completion it runs as, function-call input items, the store.
Function calls the model makes are in test_tool_calls.py (the built-in model writes them tersely)."""

from __future__ import annotations

import openai
import pytest

from stepahead.entrypoints.openai.errors import APIError
from stepahead.entrypoints.openai.protocol import ChatMessage
from stepahead.entrypoints.openai.responses_input import ResponseStore, StoredResponse
from tests.entrypoints.openai.conftest import MODEL_NAME

TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                       "required": ["city"], "additionalProperties": False}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


def _chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, **kw)


def test_text_response_is_the_chat_completion(client):
    r = client.responses.create(model=MODEL_NAME, input="Say hi", instructions="Be brief.", max_output_tokens=8,
                                temperature=0)
    chat = _chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}],
                 max_tokens=8)
    assert r.object == "response" and r.id.startswith("resp")
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert client.responses.retrieve(r.id).output_text == r.output_text


def test_streamed_events_add_up_to_the_response(client):
    kw = dict(model=MODEL_NAME, input=[{"role": "user", "content": [{"type": "input_text", "text": "Count"}]}],
              max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types.index("response.output_item.added") < types.index("response.content_part.added") < \
        types.index("response.output_text.delta")
    assert types.count("response.output_text.done") == types.count("response.output_item.done") == 1
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == text


def test_chat_tool_form_of_a_function_call_input(client):
    """A function_call item given back as input is the assistant's earlier call."""
    items = [{"role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "rain"}]
    r = client.responses.create(model=MODEL_NAME, input=items, tools=[TOOL], tool_choice="none",
                                max_output_tokens=4, temperature=0)
    chat = _chat(client, [{"role": "user", "content": "Weather?"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "rain"}],
                 tools=[CHAT_TOOL], tool_choice="none", max_tokens=4)
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.output_text == chat.choices[0].message.content


@pytest.mark.parametrize("body,param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "hi", "background": True}, "background"),
])
def test_bad_requests(http, body, param):
    r = http.post("/v1/responses", json={"model": MODEL_NAME, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_previous_response(client, http):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input="hi", previous_response_id="resp_nope")
    assert http.get("/v1/responses/resp_nope").status_code == 404


def test_not_stored_is_not_kept(client):
    r = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_store_keeps_the_newest():
    store = ResponseStore(capacity=2)
    for k in range(3):
        store.put(f"r{k}", StoredResponse([ChatMessage(role="user", content=str(k))], {"id": f"r{k}"}))
    assert len(store) == 2 and store.get("r2").body == {"id": "r2"}
    with pytest.raises(APIError) as e:
        store.get("r0")
    assert e.value.status == 404


def test_output_text_logprobs_with_include_and_top_logprobs(client):
    kw = dict(model=MODEL_NAME, input="Say hi", max_output_tokens=6, temperature=0,
              include=["message.output_text.logprobs"], top_logprobs=2)
    r = client.responses.create(**kw)
    chat = _chat(client, [{"role": "user", "content": "Say hi"}], max_tokens=6, logprobs=True, top_logprobs=2)
    logprobs = r.output[0].content[0].logprobs
    assert [(lp.token, lp.logprob) for lp in logprobs] == \
        [(lp.token, lp.logprob) for lp in chat.choices[0].logprobs.content]
    assert len(logprobs) == r.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    events = list(client.responses.create(**kw, stream=True))
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == [lp.token for lp in logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.token for lp in done.logprobs] == streamed
    plain = client.responses.create(model=MODEL_NAME, input="Say hi", max_output_tokens=6, temperature=0)
    assert plain.output[0].content[0].logprobs == []  # not asked for


def test_reasoning_effort_reaches_the_template(tiny_llama):
    """reasoning.effort here and chat's reasoning_effort reach a real chat template as its
    reasoning_effort variable (chat_template_kwargs may set it instead), and chat's documents as its
    documents."""
    from transformers import AutoTokenizer

    from stepahead.entrypoints.openai.protocol import ChatCompletionRequest
    from stepahead.entrypoints.openai.responses_input import chat_request
    from stepahead.entrypoints.openai.responses_protocol import ResponsesRequest
    from stepahead.entrypoints.openai.serving_chat import render_chat, template_kwargs

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    tokenizer.chat_template = "{{ reasoning_effort | default('unset') }}:{% for m in messages %}{{ m.content }}{% endfor %}"

    def rendered(chat: ChatCompletionRequest) -> str:
        return render_chat(tokenizer, chat.messages, False, False, template_kwargs(chat))

    chat, _ = chat_request(ResponsesRequest(input="hi", reasoning={"effort": "low"}), [])
    assert rendered(chat) == "low:hi"
    plain, _ = chat_request(ResponsesRequest(input="hi"), [])
    assert rendered(plain) == "unset:hi" and not plain.logprobs
    messages = [{"role": "user", "content": "yo"}]
    assert rendered(ChatCompletionRequest(messages=messages, reasoning_effort="high")) == "high:yo"
    assert rendered(ChatCompletionRequest(messages=messages, reasoning_effort="high",
                                          chat_template_kwargs={"reasoning_effort": "minimal"})) == "minimal:yo"
    tokenizer.chat_template = "{% for d in documents %}[{{ d.title }}]{% endfor %}{{ messages[0].content }}"
    assert rendered(ChatCompletionRequest(messages=messages, documents=[{"title": "a"}, {"title": "b"}])) == "[a][b]yo"


@pytest.mark.parametrize(("fields", "param"), [
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs", "file_search_call.results"]}, "include"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"text": {"verbosity": "low"}}, "text"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_fields_not_served_are_400s_naming_them(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, extra_body=fields)
    assert e.value.body["param"] == param, e.value.body


def test_hints_are_echoed(client):
    r = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, truncation="disabled",
                                service_tier="auto", prompt_cache_key="k1", safety_identifier="u1",
                                reasoning={"effort": "low"})
    assert (r.truncation, r.prompt_cache_key, r.safety_identifier, r.reasoning.effort) == \
        ("disabled", "k1", "u1", "low")
