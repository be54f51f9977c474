"""A grammar constrains only what follows the reasoning, end to end, on a tiny model scripted to think
"Maybe so.</think>" (tiny_models.build_scripted_model): the real engine, the real xgrammar bitmask in the
worker, and `stepahead serve --reasoning-parser deepseek_r1`, which sets the gate on every grammar, with
`--tool-call-parser qwen3_coder` reading "auto" calls after the reasoning. The served tokenizer makes the
markers special tokens (as Magistral's [THINK] is), so the split also shows the server keeps them in the
output text; the offline engine reads the same ids as ordinary added tokens."""

from __future__ import annotations

import json

import openai
import pytest

from stepahead import LLM, SamplingParams
from stepahead.sampling_params import StructuredOutputsParams as Constraint
from tests.entrypoints.openai.server_utils import RemoteServer
from tests.tiny_models import build_scripted_model, write_tokenizer

THOUGHT = "Maybe so."
ASK = [{"role": "user", "content": "Hi"}]
ANSWERS = ["yes", "no"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}]
MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")  # the parsers' markers, single tokens
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                     "<think>\n\n</think>\n\n{% endif %}")


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """The model's folder, and the token ids of its chat prompt and of its scripted output."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("scripted")
    write_tokenizer(folder, MARKERS)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    script = tokenizer.encode(THOUGHT + "</think>", add_special_tokens=False)
    chain = [prompt_ids[-1], *script]
    assert len(set(chain)) == len(chain)  # a bigram model says each token's one successor
    build_scripted_model(folder, dict(zip(chain[:-1], chain[1:], strict=True)), MARKERS)
    end = tokenizer.encode("</think>", add_special_tokens=False)
    assert len(end) == 1
    return folder, prompt_ids, script, end


def test_offline_the_model_thinks_then_the_grammar_answers(scripted):
    folder, prompt_ids, script, end = scripted
    prompt = {"prompt_token_ids": prompt_ids}
    with LLM(str(folder), executor="uni") as llm:
        (free,) = llm.generate(prompt, SamplingParams(max_tokens=len(script), temperature=0), use_tqdm=False)
        assert free.outputs[0].token_ids == script  # the script, unconstrained
        gated = SamplingParams(max_tokens=32, temperature=0,
                               structured_outputs=Constraint(choice=ANSWERS, reasoning_end_token_ids=end))
        ungated = SamplingParams(max_tokens=32, temperature=0, structured_outputs=Constraint(choice=ANSWERS))
        (after, before) = llm.generate([prompt, prompt], [gated, ungated], use_tqdm=False)
    thought, _, answer = after.outputs[0].text.partition("</think>")
    assert thought == THOUGHT and answer in ANSWERS and after.outputs[0].finish_reason == "stop"
    # The same grammar without the gate constrains the first token: the thought is gone.
    assert before.outputs[0].text in ANSWERS and before.outputs[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def client(scripted, tmp_path_factory):
    special = tmp_path_factory.mktemp("special-markers")
    write_tokenizer(special, MARKERS, special=True)  # the same ids, skipped when decoding by default
    server = RemoteServer(scripted[0], "--tokenizer", str(special), "--served-model-name", "x", "--executor", "uni",
                          "--dtype", "float32", "--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice",
                          "--tool-call-parser", "qwen3_coder", "--trust-request-chat-template")
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    server.stop()


def _script(text: str) -> dict:
    """What follows the reasoning, scripted by a grammar the reasoning gate holds back until then."""
    return {"structured_outputs": {"choice": [text]}}


def test_reasoning_and_content_apart_streamed_too(client):
    kw = dict(model="x", messages=ASK, temperature=0, max_tokens=32, extra_body=_script("Hello there!"))
    message = client.chat.completions.create(**kw).choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, "Hello there!")
    reasoning, content, chunks = "", "", 0
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        chunks += 1
    assert (reasoning, content) == (THOUGHT, "Hello there!") and chunks > 3


def test_include_reasoning_false_leaves_the_reasoning_out(client):
    kw = dict(model="x", messages=ASK, temperature=0, max_tokens=32,
              extra_body=_script("Hello there!") | {"include_reasoning": False})
    message = client.chat.completions.create(**kw).choices[0].message
    assert (message.reasoning_content, message.content) == (None, "Hello there!")
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello there!"
    assert not [c for c in chunks if getattr(c.choices[0].delta, "reasoning_content", None)]


def test_auto_tool_calls_are_read_after_the_reasoning(client):
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>")
    kw = dict(model="x", messages=ASK, tools=TOOLS, temperature=0, max_tokens=256, extra_body=_script(call))
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.message.reasoning_content == THOUGHT and choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Oslo", "days": 3})]
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(delta.index, {"name": delta.function.name, "arguments": ""})
            entry["arguments"] += delta.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Oslo", "days": 3})]


def test_a_grammar_waits_for_a_reasoning_that_never_ends(client, scripted):
    """Kept from its end marker, the model thinks freely under response_format: its reasoning is exactly
    the unconstrained output's, nothing follows it and the grammar never applies."""
    end = scripted[3][0]
    kw = dict(model="x", messages=ASK, temperature=0, max_tokens=16, logit_bias={str(end): -100})
    free = client.chat.completions.create(**kw).choices[0]
    constrained = client.chat.completions.create(**kw, response_format={"type": "json_object"}).choices[0]
    assert free.message.reasoning_content.startswith(THOUGHT)
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


def test_drafts_run_through_the_reasoning_into_the_grammar(scripted):
    """The prompt holds the thought and the answer, so n-gram drafts copy both: a draft inside the
    reasoning is followed (every token is allowed there), so is the one that ends it, and after it the
    grammar's own row decides. The output equals the undrafted one, and the drafts were accepted."""
    from transformers import AutoTokenizer

    folder, prompt_ids, script, end = scripted
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ask = [{"role": "user", "content": f"{THOUGHT}</think>yes"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(ask, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    assert prompt[-1] == prompt_ids[-1]  # the scripted model starts its thought after it
    params = SamplingParams(max_tokens=32, temperature=0,
                            structured_outputs=Constraint(choice=["yes"], reasoning_end_token_ids=end))
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    runs = {}
    for name, engine in (("plain", {}), ("drafted", {"speculative_config": ngram}),
                         ("drafted_sync", {"speculative_config": ngram, "async_scheduling": False})):
        with LLM(str(folder), executor="uni", **engine) as llm:
            (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
            runs[name] = (out.outputs[0].token_ids, out.outputs[0].text, llm.stats())
    tokens, text, _ = runs["plain"]
    assert text == f"{THOUGHT}</think>yes"
    for name in ("drafted", "drafted_sync"):
        assert runs[name][0] == tokens
        # Most of the thought came from accepted drafts (none would be, were drafts not followed there).
        assert runs[name][2].spec_num_accepted_tokens >= len(script) // 2
