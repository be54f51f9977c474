"""A non-sampling rank that applies the sampler's broadcast outcome holds the sampler's request state."""

from __future__ import annotations

import copy

import pytest
import torch

from stepahead.config import SpeculativeConfig
from stepahead.sampling_params import SamplingParams
from stepahead.worker.request_state import CachedRequestState
from stepahead.worker.spec_decode.spec_decoder import SpecDecoder, VerifiedStep, ngram_proposer
from stepahead.worker.spec_decode.step_outcome import apply_outcomes, encode_outcomes, outcome_width

K = 3


def _state(req_id: str, tokens: list[int], num_computed: int) -> CachedRequestState:
    return CachedRequestState(req_id, tokens[:4], list(tokens), [0, 1, 2, 3], num_computed, SamplingParams())


def test_applied_outcome_equals_the_samplers_state():
    """The sampler verifies and proposes; the other rank applies the encoded outcome: same tokens, same
    computed count (rejected drafts given back) and same next drafts, for a full accept, a partial one,
    a row that verified no draft and one whose proposal found nothing."""
    config = SpeculativeConfig("ngram", K, prompt_lookup_min=1, prompt_lookup_max=2)
    sampler = SpecDecoder(config, ngram_proposer(config, max_model_len=64))
    other = SpecDecoder(config, None)
    # Each row laid out its last token and drafts: the count includes them before verification.
    states = [_state("a", [5, 6, 7, 5, 6], 8), _state("b", [9, 8, 7, 6, 9, 8], 9), _state("c", [1, 2, 3, 4], 4),
              _state("d", [11, 12, 13, 14], 6)]
    drafts = [[7, 5, 6], [7, 6, 1], [], [15]]
    replicas = copy.deepcopy(states)
    for state, replica, row_drafts in zip(states, replicas, drafts, strict=True):
        sampler.step_drafts(state, row_drafts)
        other.step_drafts(replica, row_drafts)
    verified = VerifiedStep([[7, 5, 6, 7], [7, 6, 2], [1], [16]])
    sampler.propose(states, drafts, verified)
    outcomes = encode_outcomes(verified.tokens, [s.draft.drafts for s in states], K)
    assert outcomes.shape == (4, outcome_width(K)) and outcomes.dtype == torch.long
    apply_outcomes(outcomes, replicas, [len(d) for d in drafts], K)
    for state, replica in zip(states, replicas, strict=True):
        assert replica.token_ids == state.token_ids
        assert replica.num_computed_tokens == state.num_computed_tokens
        assert replica.draft.drafts == state.draft.drafts
    assert [s.num_computed_tokens for s in states] == [8, 8, 4, 5]  # 0, 1, 0 and 1 rejected drafts given back
    assert states[0].draft.drafts and not states[3].draft.drafts  # a copy drafts, a fresh run does not


def test_outcomes_refuse_what_does_not_fit():
    with pytest.raises(RuntimeError, match="5 verified tokens and 0 drafts; at most 4 and 3 fit"):
        encode_outcomes([[1, 2, 3, 4, 5]], [[]], K)
    with pytest.raises(RuntimeError, match="expected \\(2, 9\\)"):
        apply_outcomes(torch.zeros(1, outcome_width(K), dtype=torch.long), [_state("a", [1], 1)] * 2, [0, 0], K)
    with pytest.raises(RuntimeError, match="only the sampler rank proposes"):
        SpecDecoder(SpeculativeConfig("ngram", K), None).propose([], [], VerifiedStep([]))
