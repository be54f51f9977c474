"""The worker's verification keeps the target distribution, and drafting pauses where it misses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stepahead.config import SpeculativeConfig
from stepahead.sampling_params import SamplingParams
from stepahead.worker.request_state import CachedRequestState
from stepahead.worker.sampler import sample, sampling_probs
from stepahead.worker.sampling_metadata import RowSampling, SamplingMetadata
from stepahead.worker.spec_decode.draft_track import FIRST_PAUSE_STEPS, MISSES_BEFORE_PAUSE, DraftTrack
from stepahead.worker.spec_decode.spec_decoder import SpecDecoder, VerifiedStep, ngram_proposer

VOCAB = 6


def _decoder(config: SpeculativeConfig) -> SpecDecoder:
    return SpecDecoder(config, ngram_proposer(config, max_model_len=64))


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of Pearson's chi-square test of counts against probs (df = categories - 1)."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(probs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_random_rows_keep_the_target_distribution():
    """One-hot drafts verified by the accept/resample rule: the first token is distributed as the
    target's p0 whatever the draft, and the token after an accepted draft as p1."""
    torch.manual_seed(0)
    num, draft = 20000, 2
    p0 = np.array([0.05, 0.15, 0.30, 0.10, 0.25, 0.15])
    p1 = np.array([0.40, 0.05, 0.05, 0.20, 0.10, 0.20])
    logits = torch.tensor(np.log(np.stack([p0, p1])), dtype=torch.float32).repeat(num, 1)
    params = SamplingParams(temperature=1.0, max_tokens=8)
    rows = [RowSampling(params, [1], [], []) for _ in range(num)]
    decoder = _decoder(SpeculativeConfig("ngram", 1))
    step = decoder.sample_and_verify(logits, rows, [[draft]] * num)
    first = np.array([tokens[0] for tokens in step.tokens])
    second = np.array([tokens[1] for tokens in step.tokens if len(tokens) == 2])
    assert all(len(t) == 1 or t[0] == draft for t in step.tokens)  # a second token only after acceptance
    assert abs(len(second) / num - p0[draft]) < 0.02  # accepted with probability p0(draft)
    assert _chi_square_p(np.bincount(first, minlength=VOCAB), p0) > 1e-3
    assert _chi_square_p(np.bincount(second, minlength=VOCAB), p1) > 1e-3
    # The test can fail: the same counts against a distribution off by a few points are refused.
    assert _chi_square_p(np.bincount(first, minlength=VOCAB), np.roll(p0, 1)) < 1e-6


def test_seeded_rows_give_the_undrafted_tokens():
    """A seeded row's position j draws the uniform of output index n + j: with or without drafts, the same tokens."""
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    params = SamplingParams(temperature=0.9, seed=1234, max_tokens=8)
    decoder = _decoder(SpeculativeConfig("ngram", 3))
    alone = [decoder.sample_and_verify(logits[j:j + 1].clone(), [RowSampling(params, [1], [], [], 5 + j)], [[]])
             .tokens[0][0] for j in range(4)]
    drafted = decoder.sample_and_verify(logits.clone(), [RowSampling(params, [1], [], [], 5)], [alone[:3]])
    assert drafted.tokens == [alone]


def test_drafting_pauses_while_it_misses_and_resumes():
    track = DraftTrack()
    for _ in range(MISSES_BEFORE_PAUSE):
        assert track.may_propose()
        track.note_no_proposal()
    assert track.paused
    assert [track.may_propose() for _ in range(FIRST_PAUSE_STEPS)] == [False] * FIRST_PAUSE_STEPS
    assert not track.paused and track.may_propose()
    track.num_verifying = 2
    track.note_verified(1)  # a hit resets the streak and the pause length
    assert track.misses == 0 and track.next_pause == FIRST_PAUSE_STEPS


def test_propose_reports_slots_and_rolls_back_rejections():
    decoder = _decoder(SpeculativeConfig("ngram", 2, prompt_lookup_min=1, prompt_lookup_max=2))
    state = CachedRequestState("r", [5, 6, 7], [5, 6, 7, 5], [1], 6, SamplingParams(max_tokens=8))
    drafts = decoder.step_drafts(state, [-1, -1])  # nothing proposed yet: padding, which counts for nothing
    assert drafts == [5, 5] and state.draft.num_verifying == 0
    out = decoder.propose([state], [drafts], VerifiedStep([[6]]))  # both drafts rejected, the target gave 6
    assert state.token_ids == [5, 6, 7, 5, 6] and state.num_computed_tokens == 4
    assert out.draft_token_ids == {"r": [7, 5]} and out.draft_slots == {"r": 2}


def test_draft_count_follows_what_the_request_accepts():
    track = DraftTrack()
    assert track.num_drafts(4) == 4  # nothing verified yet
    for _ in range(8):
        track.num_verifying = track.num_drafts(4)
        track.note_verified(1)  # one draft accepted each step
    assert track.num_drafts(4) == 2
    for _ in range(8):
        track.num_verifying = track.num_drafts(4)
        track.note_verified(track.num_verifying)  # every draft accepted: grows back to k
    assert track.num_drafts(4) == 4
    for _ in range(MISSES_BEFORE_PAUSE):
        track.num_verifying = 1
        track.note_verified(0)
    assert track.num_drafts(4) == 0  # paused: no slots asked for


def test_a_large_batch_drafts_nothing():
    config = SpeculativeConfig("ngram", 2, prompt_lookup_min=1, prompt_lookup_max=2, disable_by_batch_size=2)
    decoder = _decoder(config)

    def states(n):
        return [CachedRequestState(f"r{i}", [5, 6, 7], [5, 6, 7, 5], [1], 4, SamplingParams(max_tokens=8))
                for i in range(n)]

    two = states(2)
    out = decoder.propose(two, [[], []], VerifiedStep([[6], [6]]))
    assert out.draft_token_ids == {"r0": [], "r1": []} and out.draft_slots == {"r0": 0, "r1": 0}
    out = decoder.propose(states(1), [[]], VerifiedStep([[6]]))
    assert out.draft_token_ids == {"r0": [7, 5]} and out.draft_slots == {"r0": 2}
    with pytest.raises(ValueError, match="disable_by_batch_size must be an int >= 1"):
        SpeculativeConfig("ngram", 2, disable_by_batch_size=0)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=4, top_p=0.85),
    SamplingParams(temperature=1.3, min_p=0.1, presence_penalty=0.4, repetition_penalty=1.2),
    SamplingParams(temperature=1.5, top_p=0.9, logit_bias={3: 0.5}),
], ids=["top_k_top_p", "min_p_penalties", "top_p_bias"])
def test_sampling_probs_is_the_law_sample_draws_from(params):
    """sampling_probs (the p of the general rejection rule) against sample's own draws."""
    draws = 20000
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.8, 0.1, -1.0]]).repeat(draws, 1)
    rows = [RowSampling(params, [0, 4], [1, 1, 5], [], 3)] * draws
    md = SamplingMetadata.from_rows(rows, VOCAB, "cpu")
    torch.manual_seed(3)
    tokens = sample(logits.clone(), md).sampled_token_ids.numpy()
    p = sampling_probs(logits[:1].clone(), SamplingMetadata.from_rows(rows[:1], VOCAB, "cpu"))[0].double().numpy()
    assert abs(p.sum() - 1) < 1e-5
    kept = p > 0
    counts = np.bincount(tokens, minlength=VOCAB)
    assert (counts[~kept] == 0).all()  # what p excludes is never drawn
    assert _chi_square_p(counts[kept], p[kept]) > 1e-3
    assert kept.sum() >= 3 and _chi_square_p(counts[kept], np.roll(p[kept], 1)) < 1e-6
