"""vLLM's test_tokenization.py (/tokenize, /detokenize, /tokenizer_info) against `stepahead serve`,
compared with transformers' tokenizer of the same checkpoint."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.vllm_compat.conftest import MAX_MODEL_LEN, MODEL

CONVERSATION = [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Nice to meet you!"},
                {"role": "user", "content": "Can I ask a question? vllm1"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}}}}]


def _tokenized(http, body: dict) -> dict:
    resp = http.post("/tokenize", json={"model": MODEL, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _check(result: dict, tokens: list[int], token_strs=None) -> None:
    assert result["tokens"] == tokens and result["count"] == len(tokens)
    assert result["max_model_len"] == MAX_MODEL_LEN and result["token_strs"] == token_strs


def test_tokenize_completions(http, tokenizer):
    prompt = "vllm1 This is a test prompt."
    for add_special in (False, True):
        _check(_tokenized(http, {"prompt": prompt, "add_special_tokens": add_special}),
               tokenizer.encode(prompt, add_special_tokens=add_special))


def _chat_cases():
    for add_generation in (False, True):
        for add_special in (False, True):
            for continue_final in (False, True):
                if not (add_generation and continue_final):
                    yield add_generation, add_special, continue_final


def _check_chat(http, tokenizer, conversation: list[dict], tools=None) -> None:
    for add_generation, add_special, continue_final in _chat_cases():
        messages = conversation + ([{"role": "assistant", "content": "Sure,"}] if continue_final else [])
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation,
                                               continue_final_message=continue_final, tokenize=False)
        body = {"messages": messages, "add_generation_prompt": add_generation, "continue_final_message": continue_final,
                "add_special_tokens": add_special}
        if tools is not None:
            body["tools"] = tools
        _check(_tokenized(http, body), tokenizer.encode(prompt, add_special_tokens=add_special))


def test_tokenize_chat(http, tokenizer):
    _check_chat(http, tokenizer, CONVERSATION)


def test_tokenize_chat_with_tools(http, tokenizer):
    _check_chat(http, tokenizer, [{"role": "user", "content": "What's the weather like in Paris today?"}], TOOLS)


def test_tokenize_with_return_token_strs(http, tokenizer):
    prompt = "This is a token_strs test prompt! vllm1"
    tokens = tokenizer.encode(prompt, add_special_tokens=True)
    _check(_tokenized(http, {"prompt": prompt, "return_token_strs": True}), tokens,
           tokenizer.convert_ids_to_tokens(tokens))


def test_detokenize(http, tokenizer):
    prompt = "This is a test prompt. vllm1"
    resp = http.post("/detokenize", json={"model": MODEL, "tokens": tokenizer.encode(prompt, add_special_tokens=False)})
    assert resp.status_code == 200 and resp.json() == {"prompt": prompt}


@pytest.fixture(scope="module")
def info(http) -> dict:
    resp = http.get("/tokenizer_info")
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_tokenizer_info_basic(info):
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]


def test_tokenizer_info_schema(info):
    types = {"add_bos_token": bool, "add_prefix_space": bool, "clean_up_tokenization_spaces": bool,
             "split_special_tokens": bool, "bos_token": str, "eos_token": str, "pad_token": str, "unk_token": str,
             "chat_template": str, "errors": str, "model_max_length": int, "additional_special_tokens": list,
             "added_tokens_decoder": dict}
    for name, kind in types.items():
        if info.get(name) is not None:
            assert isinstance(info[name], kind), name
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"]  # the tiny checkpoint's own


def test_tokenizer_info_added_tokens_structure(info):
    added = info["added_tokens_decoder"]
    assert added  # the tiny tokenizer's three special tokens
    for token_id, token in added.items():
        assert token_id.isdigit() and isinstance(token["content"], str) and isinstance(token["special"], bool)


def test_tokenizer_info_consistency_with_tokenize(http, info):
    assert info["model_max_length"] >= _tokenized(http, {"prompt": "Hello world!"})["max_model_len"]


def test_tokenizer_info_chat_template(info, tokenizer):
    assert info["chat_template"] == tokenizer.chat_template
