"""The LLM tests' shared fixture: one LLM on the tiny Llama per test module, worker in process."""

from __future__ import annotations

import pytest

from stepahead import LLM


@pytest.fixture(scope="module")
def llm(tiny_llama, request):
    """Its context length is the module's MAX_MODEL_LEN (error messages quote it)."""
    with LLM(str(tiny_llama), executor="uni", max_model_len=request.module.MAX_MODEL_LEN) as llm:
        yield llm
