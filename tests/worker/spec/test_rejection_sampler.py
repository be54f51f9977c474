"""Greedy verification: the accepted prefix and the token after it, as plain decoding gives them."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stepahead.worker.spec.rejection_sampler import accepted_lists, greedy_verify


def test_hand_made_rows():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 0, 7], [9, 9, 9]])
    num_drafts = torch.tensor([3, 3, 3, 0])
    target = torch.tensor([[5, 6, 7, 8], [1, 6, 7, 8], [5, 6, 7, 8], [4, 9, 9, 9]])
    num_accepted, output = greedy_verify(drafts, num_drafts, target)
    assert num_accepted.tolist() == [3, 0, 1, 0]
    # All accepted: the bonus token follows; none: the target's own token; padding is never accepted.
    assert accepted_lists(num_accepted, output) == [[5, 6, 7, 8], [1], [5, 6], [4]]


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=4, max_size=4),
                               st.lists(st.integers(0, 2), min_size=5, max_size=5), st.integers(0, 4)),
                     min_size=1, max_size=6))
def test_equals_the_sequential_rule(rows):
    drafts = torch.tensor([r[0] for r in rows])
    target = torch.tensor([r[1] for r in rows])
    num_drafts = torch.tensor([r[2] for r in rows])
    got = accepted_lists(*greedy_verify(drafts, num_drafts, target))
    for (d, t, n), tokens in zip(rows, got, strict=True):
        expected = []
        for j in range(n + 1):
            expected.append(t[j])
            if j == n or d[j] != t[j]:
                break
        assert tokens == expected
