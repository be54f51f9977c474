"""Verification: the accepted prefix and the token after it, as plain decoding gives them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepahead.worker.spec.rejection_sampler import accept_drafts


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
