from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer

MODEL_NAME = "tiny-llama"
# Small KV pool (preemption under load is part of what the server must survive), worker in its own process.
SERVER_ARGS = ["--served-model-name", MODEL_NAME, "--dtype", "float32", "--num-kv-blocks", "128",
               "--max-num-seqs", "64", "--executor", "mp", "--num-threads", "1"]


@pytest.fixture(scope="session")
def server(tiny_llama):
    srv = RemoteServer(tiny_llama, *SERVER_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def tokenizer_folder(tmp_path_factory):
    """The tiny models' tokenizer alone (no model), for tests that tokenize or render templates."""
    from tests.tiny_models import write_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(folder)
    return folder
