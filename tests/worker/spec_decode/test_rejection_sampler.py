"""Verification: the accepted prefix and the token after it, as plain decoding gives them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stepahead.worker.spec_decode.rejection_sampler import accept_drafts, rejection_sample


def test_hand_made_rows():
    drafts = [[5, 6, 7], [5, 6, 7], [5, 0, 7], []]
    targets = [5, 6, 7, 8, 1, 6, 7, 8, 5, 6, 7, 8, 4]
    # All accepted: the bonus token follows; none: the target's own token; no drafts: one token.
    assert accept_drafts(drafts, targets) == [[5, 6, 7, 8], [1], [5, 6], [4]]


def test_target_count_must_match_positions():
    with pytest.raises(ValueError, match="3 target samples for 2 positions"):
        accept_drafts([[1]], [1, 2, 3])


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(st.lists(st.integers(0, 2), max_size=4),
                               st.lists(st.integers(0, 2), min_size=5, max_size=5)), min_size=1, max_size=6))
def test_equals_the_sequential_rule(rows):
    drafts = [d for d, _ in rows]
    targets = [x for d, t in rows for x in t[:len(d) + 1]]
    got = accept_drafts(drafts, targets)
    for (d, t), tokens in zip(rows, got, strict=True):
        expected = []
        for j in range(len(d) + 1):
            expected.append(t[j])
            if j == len(d) or d[j] != t[j]:
                break
        assert tokens == expected


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of Pearson's chi-square test of counts against probs (df = categories - 1)."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_general_rule_keeps_the_target_distribution():
    """Drafts drawn from q (far from p, not one-hot), verified by the general rule: the first token is
    distributed as p0 and the one after an accepted first draft as p1, not as q."""
    trials, vocab = 40000, 5
    p0 = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10], dtype=torch.float64)
    p1 = torch.tensor([0.30, 0.05, 0.15, 0.10, 0.40], dtype=torch.float64)
    p2 = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    q0 = torch.tensor([0.50, 0.10, 0.10, 0.20, 0.10], dtype=torch.float64)
    q1 = torch.tensor([0.10, 0.40, 0.10, 0.30, 0.10], dtype=torch.float64)
    gen = torch.Generator().manual_seed(11)
    x0 = torch.multinomial(q0.float(), trials, replacement=True, generator=gen)
    x1 = torch.multinomial(q1.float(), trials, replacement=True, generator=gen)
    target = torch.stack([p0, p1, p2]).float().repeat(trials, 1)  # 3 positions a request
    draft_probs = torch.stack([q0, q1]).float().repeat(trials, 1)
    draft_ids = torch.stack([x0, x1], dim=1).reshape(-1)
    tokens = rejection_sample(target, draft_probs, draft_ids, [2] * trials,
                              torch.rand(2 * trials, generator=gen), torch.rand(3 * trials, generator=gen))
    first = np.array([t[0] for t in tokens])
    second = np.array([t[1] for t in tokens if len(t) >= 2])
    assert 0.3 * trials < len(second) < 0.9 * trials  # drafts both accepted and rejected
    assert _chi_square_p(np.bincount(first, minlength=vocab), p0.numpy()) > 1e-3
    assert _chi_square_p(np.bincount(second, minlength=vocab), p1.numpy()) > 1e-3
    # The test can fail: the drafts themselves are distributed as q, not p.
    assert _chi_square_p(np.bincount(x0.numpy(), minlength=vocab), p0.numpy()) < 1e-6


def test_general_rule_rows_of_any_length_and_one_hot_q():
    """Rows with 0..2 drafts side by side; a one-hot q on the target's one-hot p accepts while equal."""
    vocab = 4
    eye = torch.eye(vocab)
    target = eye[[1, 2, 3, 0, 2, 2]]  # row A (2 drafts): 1, 2, 3; row B (0): 0; row C (1): 2, 2
    drafts = torch.tensor([1, 0, 2])  # A: 1 accepted, 0 rejected; C: 2 accepted
    tokens = rejection_sample(target, eye[drafts], drafts, [2, 0, 1], torch.full((3,), 0.5), torch.full((6,), 0.5))
    assert tokens == [[1, 2], [0], [2, 2]]
    same = rejection_sample(target, eye[drafts], drafts, [2, 0, 1], torch.full((3,), 0.5), torch.full((6,), 0.5))
    assert same == tokens  # a function of its uniforms: seeded rows reproduce
