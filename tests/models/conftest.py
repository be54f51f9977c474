"""Fixtures the model-family tests share."""

import pytest


@pytest.fixture(params=["kernel", "sdpa"])
def attention_path(request, monkeypatch):
    """float32 on CPU runs stepahead's kernels (attention, rope, norms); without them, torch's (SDPA)."""
    if request.param == "sdpa":
        monkeypatch.setattr("stepahead.kernels.cpu_build.available", lambda: False)
    return request.param
