"""The n-gram proposer against a direct reading of its rule, and on hand-made cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepahead.worker.spec_decode.ngram_proposer import NgramProposer


def _reference(tokens: list[int], k: int, lo: int, hi: int, max_model_len: int) -> list[int]:
    """Longest n in [lo, hi] first, then the earliest earlier occurrence followed by a known token."""
    total = len(tokens)
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    for n in range(min(hi, total - 1), lo - 1, -1):
        suffix = tokens[total - n:]
        for start in range(0, total - n):  # the match ends at start + n - 1 <= total - 2
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40), k=st.integers(1, 5),
       lo=st.integers(1, 3), extra=st.integers(0, 3), max_model_len=st.integers(1, 60))
def test_matches_the_rule(tokens, k, lo, extra, max_model_len):
    proposer = NgramProposer(k, lo, lo + extra, max_model_len)
    got = proposer.propose(np.array(tokens, dtype=np.int64)).tolist()
    assert got == _reference(tokens, k, lo, lo + extra, max_model_len)


def test_copies_what_followed_the_earlier_occurrence():
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    # "7 8 9" occurred before, followed by 1 2 3.
    assert p.propose(np.array([5, 7, 8, 9, 1, 2, 3, 4, 7, 8, 9])).tolist() == [1, 2, 3]
    # The longer match wins over an earlier shorter one: "8 9" after 0, "6 8 9" after 4.
    assert p.propose(np.array([8, 9, 0, 6, 8, 9, 4, 5, 6, 8, 9])).tolist() == [4, 5, 6]
    # No match of prompt_lookup_min tokens: nothing proposed.
    assert p.propose(np.array([1, 2, 3, 4, 5, 3])).tolist() == []
    # Never past the known tokens, nor max_model_len.
    assert p.propose(np.array([1, 2, 9, 1, 2])).tolist() == [9, 1, 2]
    assert NgramProposer(3, 2, 3, max_model_len=6).propose(np.array([1, 2, 9, 1, 2])).tolist() == [9]
    assert p.propose_batch([np.array([4, 4, 4]), np.array([1])])[0].tolist() == [4]


def test_settings_are_checked():
    with pytest.raises(ValueError, match="prompt_lookup_max must be >= prompt_lookup_min"):
        NgramProposer(2, prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        NgramProposer(0)
