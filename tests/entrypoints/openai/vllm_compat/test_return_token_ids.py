"""vLLM's basic/test_return_token_ids.py: `return_token_ids` puts the prompt's and the output's token ids
in the response, streamed or not."""

from __future__ import annotations

from tests.entrypoints.openai.vllm_compat.conftest import MODEL

WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}]


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_basic_completion_with_emoji(client, tokenizer):
    prompt = "Complete this sentence with emojis: I love coding 🚀"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=1,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert _contains(choice.prompt_token_ids, tokenizer.encode(prompt))
    assert len(choice.token_ids) > 0 and tokenizer.decode(choice.token_ids).startswith(choice.text)
    without = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=1,
                                        extra_body={"return_token_ids": False}).model_dump()
    assert without["choices"][0].get("token_ids") is None and without.get("prompt_token_ids") is None


def test_chat_completion_with_tool_use(client, tokenizer):
    kw = {"model": MODEL, "tools": WEATHER_TOOL, "tool_choice": "auto", "max_tokens": 100, "temperature": 0,
          "logprobs": True, "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                         {"role": "user", "content": "What's the weather like in Paris?"}]}
    out = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    prompt_text = tokenizer.decode(out.prompt_token_ids)
    assert "You are a helpful assistant" in prompt_text and "What's the weather like in Paris?" in prompt_text
    assert len(tokenizer.decode(out.choices[0].token_ids)) > 0 and out.choices[0].message.content is not None
    for call in out.choices[0].message.tool_calls or []:
        assert call.function.name == "get_weather"
    without = client.chat.completions.create(**kw, extra_body={"return_token_ids": False})
    assert getattr(without.choices[0], "token_ids", None) is None and getattr(without, "prompt_token_ids", None) is None


def test_comparison_with_prompt_logprobs_and_logprobs(client, tokenizer):
    out = client.completions.create(model=MODEL, prompt="Hello, world! How are you today?", max_tokens=20,
                                    temperature=0, echo=True, logprobs=1, extra_body={
                                        "return_token_ids": True, "return_tokens_as_token_ids": True, "prompt_logprobs": 1})
    choice = out.choices[0]
    assert choice.prompt_logprobs is not None and choice.logprobs is not None
    logprob_ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    # echo: the logprobs cover prompt and output; token_ids only the output, prompt_token_ids the prompt
    assert len(choice.token_ids) < len(logprob_ids)
    assert logprob_ids == choice.prompt_token_ids + choice.token_ids
    assert "Hello, world" in tokenizer.decode(choice.prompt_token_ids)
    assert choice.text.endswith(tokenizer.decode(choice.token_ids))
    prompt_ids, ids, logprob_ids = None, [], []
    for chunk in client.completions.create(model=MODEL, prompt="Tell me a short fact about Python:", max_tokens=30,
                                           temperature=0, stream=True, logprobs=1, extra_body={
                                               "return_token_ids": True, "return_tokens_as_token_ids": True}):
        c = chunk.choices[0]
        logprob_ids += [int(t.removeprefix("token_id:")) for t in c.logprobs.tokens]
        if prompt_ids is None:
            prompt_ids = c.prompt_token_ids
        ids += c.token_ids
    assert len(prompt_ids) > 0 and ids == logprob_ids and len(ids) == 30


def test_chat_completion_with_emoji_and_token_ids(client, tokenizer):
    messages = [{"role": "system", "content": "You like to use emojis in your responses."},
                {"role": "user", "content": "Repeat after me: I love cats 🐱"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=50, temperature=0, logprobs=True,
                                         extra_body={"return_token_ids": True})
    prompt_text = tokenizer.decode(out.prompt_token_ids)
    assert "You like to use emojis in your responses" in prompt_text and "I love cats 🐱" in prompt_text
    assert len(tokenizer.decode(out.choices[0].token_ids)) > 0 and out.choices[0].message.content is not None
    content, ids = "", []
    for i, chunk in enumerate(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=50, temperature=0,
                                                             stream=True, extra_body={"return_token_ids": True})):
        dumped = chunk.model_dump()
        if i == 0:
            assert tokenizer.decode(chunk.prompt_token_ids) == prompt_text
        else:
            assert "prompt_token_ids" not in dumped, "only the first chunk carries the prompt"
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            ids += dumped["choices"][0].get("token_ids") or []
    assert content and ids == out.choices[0].token_ids
