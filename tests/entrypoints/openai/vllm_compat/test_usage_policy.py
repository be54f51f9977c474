"""vLLM's completion/ and chat_completion/test_usage_policy.py: usage always in a whole response, in a
stream only when stream_options.include_usage asks (a last chunk with no choices)."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.vllm_compat.conftest import MODEL


def _create(client, endpoint: str, **kw):
    if endpoint == "completions":
        return client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0.0, **kw)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                          max_completion_tokens=5, temperature=0.0, **kw)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_non_streaming(client, endpoint):
    out = _create(client, endpoint, stream=False)
    assert out.usage.prompt_tokens > 0 and out.usage.completion_tokens > 0


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streaming_no_usage(client, endpoint):
    assert not any(c.usage is not None and not c.choices for c in _create(client, endpoint, stream=True))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streaming_with_usage_option(client, endpoint):
    usage_chunks = [c for c in _create(client, endpoint, stream=True, stream_options={"include_usage": True})
                    if c.usage is not None and not c.choices]
    assert len(usage_chunks) == 1 and usage_chunks[0].usage.prompt_tokens > 0
