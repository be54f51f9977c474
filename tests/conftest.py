from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

import pytest
import torch

from tests.tiny_models import build_tiny_model

# The suite converts models into a model cache of its own, not the user's (unless one is given).
if "STEPAHEAD_CACHE" not in os.environ:
    os.environ["STEPAHEAD_CACHE"] = tempfile.mkdtemp(prefix="stepahead-test-cache-")
    atexit.register(shutil.rmtree, os.environ["STEPAHEAD_CACHE"], True)

if not torch.cuda.is_available():
    # The Triton kernels run through Triton's interpreter without a GPU; it must be chosen before triton
    # is first imported, and spawned workers inherit it.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """tiny_model_factory(arch="llama", **config_overrides) -> folder of a tiny random checkpoint."""
    cache: dict = {}

    def make(arch: str = "llama", **overrides):
        key = (arch, json.dumps(overrides, sort_keys=True))  # overrides may hold dicts (rope_parameters)
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = build_tiny_model(folder, arch, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory):
    return tiny_model_factory("llama")
