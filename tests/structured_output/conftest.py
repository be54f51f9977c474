from __future__ import annotations

import pytest

from stepahead import LLM


@pytest.fixture(scope="module")
def smollm():
    """The built-in SmolLM2-135M-Instruct: a real model and tokenizer, so grammars constrain real text."""
    with LLM(max_num_seqs=256) as llm:
        yield llm


def chat_prompt(llm: LLM, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True)
