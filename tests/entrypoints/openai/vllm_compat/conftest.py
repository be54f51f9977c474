"""The folder's servers: one for most files, with the flags vLLM's files start theirs with where
stepahead has them (usage details, no prefix caching so cached_tokens is 0, vLLM's metric names, the
tokenizer-info endpoint, the hermes tool parser); one with the flags that change every response
(--max-logprobs lifting the cap, --return-tokens-as-token-ids) for test_chat_echo and the server-flag case
of test_return_tokens_as_ids. and one on the built-in SmolLM2-135M-Instruct, a real model, for the cases whose output is JSON under a
grammar (function calling, a JSON-schema chat): the grammar allows whitespace anywhere, and the random
tiny model writes it until max_tokens."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from stepahead.models.loading.loader import builtin_model_path
from tests.entrypoints.openai.server_utils import RemoteServer
from tests.tiny_models import VOCAB_SIZE

MODEL = "tiny-llama"
MAX_MODEL_LEN = 512
REAL_MODEL = "smollm2"
BASE_ARGS = ("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
             "--max-num-seqs", "128", "--executor", "uni", "--num-threads", "1")
SERVER_ARGS = (*BASE_ARGS, "--enable-prompt-tokens-details", "--no-enable-prefix-caching", "--metrics-prefix", "vllm",
               "--enable-tokenizer-info-endpoint", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def openai_client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def compat_server(tiny_llama):
    srv = RemoteServer(tiny_llama, *SERVER_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def flags_client(tiny_llama):
    srv = RemoteServer(tiny_llama, *BASE_ARGS, "--max-logprobs", str(VOCAB_SIZE), "--return-tokens-as-token-ids")
    yield openai_client(srv)
    srv.stop()


@pytest.fixture(scope="session")
def real_client():
    srv = RemoteServer(builtin_model_path(), "--served-model-name", REAL_MODEL, "--max-model-len", "1024",
                       "--executor", "uni", "--num-threads", "1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield openai_client(srv)
    srv.stop()


@pytest.fixture(scope="session")
def client(compat_server):
    return openai_client(compat_server)


@pytest.fixture(scope="session")
def http(compat_server):
    with httpx.Client(base_url=compat_server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)
