"""Offline LLM.chat with vLLM's keywords: tools reach the chat template, a template of the caller's,
continue_final_message, chat_template_kwargs. The prompt must be exactly the one transformers' own
apply_chat_template renders, and the output the one generate() gives on those token ids."""

from __future__ import annotations

import pytest

from stepahead import SamplingParams
from stepahead.validation import InvalidInputError

MAX_MODEL_LEN = 512  # of the module's `llm` (tests/engine/conftest.py)

# A template that renders the tools (as their names and JSON) and a continued final message, the way
# tool-calling templates do.
TOOLS_TEMPLATE = (
    "{% if style is defined %}[{{ style }}]{% endif %}{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}={{ t.function | tojson }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if not (continue_final_message and loop.last) %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = [{"role": "user", "content": "weather in paris"}]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _reference(llm, conversation, **kwargs) -> str:
    return llm.get_tokenizer().apply_chat_template(conversation, tokenize=False, chat_template=TOOLS_TEMPLATE,
                                                   **kwargs)


def test_tools_reach_the_template(llm):
    (out,) = llm.chat(ASK, GREEDY, use_tqdm=False, chat_template=TOOLS_TEMPLATE, tools=TOOLS)
    assert out.prompt == _reference(llm, ASK, tools=TOOLS, add_generation_prompt=True)
    assert '<|im_start|>system\nTools: get_weather={"name": "get_weather", "description": "Weather' in out.prompt
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    (ref,) = llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    (without,) = llm.chat(ASK, GREEDY, use_tqdm=False, chat_template=TOOLS_TEMPLATE)
    assert "Tools:" not in without.prompt and out.prompt.endswith(without.prompt)


def test_continue_final_message_and_template_kwargs(llm):
    conversation = [*ASK, {"role": "assistant", "content": "It is"}]
    (out,) = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=TOOLS_TEMPLATE, tools=TOOLS,
                      add_generation_prompt=False, continue_final_message=True,
                      chat_template_kwargs={"style": "brief"})
    assert out.prompt == _reference(llm, conversation, tools=TOOLS, add_generation_prompt=False,
                                    continue_final_message=True, style="brief")
    assert out.prompt.startswith("[brief]") and out.prompt.endswith("<|im_start|>assistant\nIt is")


@pytest.mark.parametrize(("kwargs", "param"), [
    (dict(continue_final_message=True), "continue_final_message"),  # add_generation_prompt is on by default
    (dict(tools={"type": "function"}), "tools"),
    (dict(tools=["get_weather"]), "tools"),
    (dict(chat_template_kwargs={"tools": TOOLS}), "chat_template_kwargs"),
])
def test_bad_chat_arguments_name_themselves(llm, kwargs, param):
    with pytest.raises(InvalidInputError) as e:
        llm.chat(ASK, GREEDY, use_tqdm=False, chat_template=TOOLS_TEMPLATE, **kwargs)
    assert e.value.param == param
