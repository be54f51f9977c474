from __future__ import annotations

import re

import pytest

from stepahead import LLM
from stepahead.models.loading.loader import load_model_config, load_tokenizer
from stepahead.structured_output import StructuredOutputManager


@pytest.fixture(scope="session")
def smollm():
    """The built-in SmolLM2-135M-Instruct: a real model and tokenizer, so grammars constrain real text
    (one engine for the session: loading it is the slow part of these tests)."""
    with LLM(max_num_seqs=256) as llm:
        yield llm


def chat_prompt(llm: LLM, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True)


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def has_whitespace_outside_strings(json_text: str) -> bool:
    """Whether JSON text has whitespace between its tokens (what compact JSON never has)."""
    return any(ch.isspace() for ch in _JSON_STRING.sub('""', json_text))


@pytest.fixture(scope="session")
def model_config():
    return load_model_config(None, "cpu")


@pytest.fixture(scope="session")
def tokenizer(model_config):
    """The built-in model's real tokenizer, without the model."""
    return load_tokenizer(model_config)


@pytest.fixture
def manager(model_config, tokenizer):
    m = StructuredOutputManager(lambda: tokenizer, model_config.vocab_size, [model_config.eos_token_id])
    yield m
    m.shutdown()
