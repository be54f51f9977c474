"""vLLM's completion/test_prompt_validation.py: the cases about prompts stepahead takes (token ids and
text; prompt embeddings and hidden-state transfer are vLLM features stepahead does not have)."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.vllm_compat.conftest import MODEL


def test_empty_prompt(client):
    """vLLM sends no prompt and empty prompt_embeds; stepahead has no prompt embeddings, so it names
    prompt_embeds as unsupported, and a request with no prompt at all is refused naming prompt."""
    with pytest.raises(openai.BadRequestError, match="prompt_embeds"):
        client.completions.create(model=MODEL, prompt="", max_tokens=5, temperature=0.0, extra_body={"prompt_embeds": []})
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model=MODEL, prompt=None, max_tokens=5, temperature=0.0)


def test_out_of_vocab_token_ids(client):
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        client.completions.create(model=MODEL, prompt=[999999], max_tokens=5, temperature=0.0)
