"""The draft model's proposals are its own greedy continuation (transformers' in float32), batched
across requests, and stay so after drafts are rejected: its KV follows the verified tokens."""

from __future__ import annotations

import pytest

from stepahead.engine.arg_utils import EngineArgs
from stepahead.sampling_params import SamplingParams
from stepahead.worker.request_state import CachedRequestState
from stepahead.worker.spec_decode.draft_model_proposer import DraftModelProposer
from tests.tiny_models import VOCAB_SIZE, hf_greedy

K = 3
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama", tie_word_embeddings=True)


def _proposer(model) -> DraftModelProposer:
    args = EngineArgs(model=str(model), max_model_len=128, block_size=BLOCK_SIZE, speculative_config={
        "method": "draft_model", "model": str(model), "num_speculative_tokens": K})
    config = args.create_engine_config()
    proposer = DraftModelProposer(config)
    proposer.allocate_kv(config.cache_config.num_blocks)
    return proposer


def _state(req_id: str, prompt: list[int], first_block: int) -> CachedRequestState:
    # Blocks for the prompt only: the drafts past them go to the proposer's scratch blocks.
    blocks = list(range(first_block, first_block + (len(prompt) + BLOCK_SIZE - 1) // BLOCK_SIZE))
    return CachedRequestState(req_id, list(prompt), list(prompt), blocks, len(prompt) - 1,
                              SamplingParams(temperature=0.0, max_tokens=32))


def test_proposals_follow_the_verified_tokens(model):
    proposer = _proposer(model)
    a = _state("a", [(7 * i + 3) % VOCAB_SIZE for i in range(16)], first_block=1)  # fills its block exactly
    b = _state("b", [(11 * i + 5) % VOCAB_SIZE for i in range(21)], first_block=10)
    first = proposer.propose([a, b], [K, 2]).token_ids
    expected = hf_greedy(model, [a.token_ids, b.token_ids], K)
    assert first == [expected[0], expected[1][:2]]
    # a: its first draft accepted, the second rejected for another token; b: every draft rejected.
    a.token_ids += [first[0][0], (first[0][1] + 1) % VOCAB_SIZE]
    b.token_ids += [(first[1][0] + 1) % VOCAB_SIZE]
    a.block_ids.append(2)  # the target allocated a's next block meanwhile
    second = proposer.propose([a, b], [K, K]).token_ids
    assert second == hf_greedy(model, [a.token_ids, b.token_ids], K)
    assert a.draft.model_computed == len(a.token_ids) and b.draft.model_computed == len(b.token_ids)
