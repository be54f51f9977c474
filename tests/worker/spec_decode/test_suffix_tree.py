"""The suffix trie against brute force over random sequences: its counts, its matches and its drafts,
in both implementations (Python's, and C++'s where the CPU kernels build)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepahead.kernels import cpu_build
from stepahead.worker.spec_decode.cpu_suffix_trie import NativeSuffixTrie
from stepahead.worker.spec_decode.suffix_tree import Frontier, SuffixIndex, SuffixTrie

needs_kernels = pytest.mark.skipif(not cpu_build.machine_can_build(), reason="needs an AVX2 CPU and a C++ compiler")
TRIES = pytest.mark.parametrize("make_trie", [SuffixTrie, pytest.param(NativeSuffixTrie, marks=needs_kernels)],
                                ids=["python", "cpp"])

sequences_st = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=4)


def _substring_counts(sequences: list[list[int]], max_depth: int) -> Counter:
    counts: Counter = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(len(seq), start + max_depth) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def _index(trie: SuffixIndex, seq: list[int]) -> Frontier:
    """Index seq a token at a time, as the proposer does step by step."""
    frontier: Frontier = []
    for token in seq:
        frontier = trie.extend(frontier, [token])
    return frontier


def _reference_draft(counts: Counter, context: list[int], own: bool, depth: int, k: int, factor: float,
                     min_prob: float) -> tuple[list[int], float]:
    """Every match length, longest first; the likeliest continuation by counts; the best total probability
    wins (the longer match among equals)."""
    best: tuple[list[int], float] = ([], 0.0)
    for length in range(min(len(context), depth), 0, -1):
        current = tuple(context[-length:])
        if counts[current] == 0:
            continue
        budget = min(k, int(factor * length), depth - length)
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < budget:
            nexts = [(counts[current + (x,)], -x) for x in range(4) if counts[current + (x,)] > 0]
            if not nexts:
                break
            count, neg = max(nexts)
            ends_context = own and tuple(context[len(context) - len(current):]) == current
            total = counts[current] - (1 if ends_context else 0)
            prob *= count / total
            if prob < min_prob:
                break
            tokens.append(-neg)
            score += prob
            current = current + (-neg,)
        if score > best[1]:
            best = (tokens, score)
    return best


@settings(max_examples=200, deadline=None)
@given(sequences=sequences_st, depth=st.integers(2, 8), k=st.integers(1, 6),
       factor=st.sampled_from([0.5, 1.0, 2.0]), min_prob=st.sampled_from([0.0, 0.1, 0.4]))
@TRIES
def test_own_trie_counts_and_drafts(make_trie: Callable[[int], SuffixIndex], sequences, depth, k, factor, min_prob):
    """The request's own trie: every sequence indexed, the last one is the context (its end open)."""
    trie = make_trie(depth)
    for seq in sequences[:-1]:
        _index(trie, seq)
    frontier = _index(trie, sequences[-1])
    counts = _substring_counts(sequences, depth)
    assert trie.substring_counts() == +counts
    assert trie.num_nodes == len(+counts)
    trie.extend([], sequences[-1])  # the whole sequence in one call: as one token at a time
    assert trie.substring_counts() == +(counts + _substring_counts([sequences[-1]], depth))
    trie.retract(sequences[-1])  # back to before (most frequent children rescanned)
    draft = trie.draft(frontier, k, factor, min_prob, open_frontier=True)
    tokens, score = _reference_draft(counts, sequences[-1], True, depth, k, factor, min_prob)
    assert draft.tokens == tokens
    assert abs(draft.score - score) < 1e-9


@settings(max_examples=200, deadline=None)
@given(sequences=sequences_st, retracted=st.sets(st.integers(0, 3)), context=st.lists(st.integers(0, 3), max_size=20),
       depth=st.integers(2, 8), k=st.integers(1, 6), min_prob=st.sampled_from([0.0, 0.1, 0.4]))
@TRIES
def test_shared_trie_retracts_and_matches(make_trie: Callable[[int], SuffixIndex], sequences, retracted, context,
                                          depth, k, min_prob):
    """The shared trie: sequences added then some removed (counts and most frequent children follow),
    then added again (removed nodes reused); a context that is not indexed matches its suffixes found
    there, incrementally or from scratch."""
    trie = make_trie(depth)
    for seq in sequences:
        _index(trie, seq)
    kept = [seq for i, seq in enumerate(sequences) if i not in retracted]
    for i in sorted(retracted):
        if i < len(sequences):
            trie.retract(sequences[i])
    counts = _substring_counts(kept, depth)
    assert trie.substring_counts() == +counts
    assert trie.num_nodes == len(+counts)
    for i in sorted(retracted)[:1]:
        if i < len(sequences):
            trie.extend([], sequences[i])
            trie.retract(sequences[i])
            assert trie.substring_counts() == +counts
    matched: Frontier = []
    for token in context:
        matched = trie.match(matched, [token])
    found = [length for length in range(1, min(len(context), depth) + 1) if counts[tuple(context[-length:])]]
    assert len(matched) == len(found) and found == list(range(1, len(found) + 1))
    assert [trie.count(node) for node in matched] == [counts[tuple(context[-n:])] for n in found]
    assert [trie.count(node) for node in trie.match_tokens(context)] == [trie.count(node) for node in matched]
    assert trie.match([], context) == trie.match_tokens(context)
    draft = trie.draft(matched, k, 1.0, min_prob, open_frontier=False)
    tokens, score = _reference_draft(counts, context, False, depth, k, 1.0, min_prob)
    assert (draft.tokens, round(draft.score, 9)) == (tokens, round(score, 9))


@TRIES
def test_a_longer_match_drafts_longer(make_trie: Callable[[int], SuffixIndex]):
    """max_spec_factor x match length caps the draft: a 2-token match drafts 2 tokens at factor 1."""
    trie = make_trie(16)
    _index(trie, [5, 6, 7, 8, 9, 10, 11])
    context = [1, 6, 7]
    matched = trie.match_tokens(context)
    assert len(matched) == 2
    assert trie.draft(matched, 8, 1.0, 0.1, open_frontier=False).tokens == [8, 9]
    assert trie.draft(matched, 8, 2.0, 0.1, open_frontier=False).tokens == [8, 9, 10, 11]
    assert trie.draft(matched, 3, 2.0, 0.1, open_frontier=False).tokens == [8, 9, 10]


@TRIES
def test_unlikely_continuations_are_cut(make_trie: Callable[[int], SuffixIndex]):
    """After [1, 2] came 3 three times and 4 once: 3 has probability 0.75; 0.8 cuts it."""
    trie = make_trie(8)
    for tail in (3, 3, 3, 4):
        _index(trie, [1, 2, tail])
    matched = trie.match_tokens([1, 2])
    assert trie.draft(matched, 4, 1.0, 0.7, open_frontier=False).tokens == [3]
    assert trie.draft(matched, 4, 1.0, 0.8, open_frontier=False).tokens == []


@TRIES
def test_bad_input_is_named(make_trie: Callable[[int], SuffixIndex]):
    with pytest.raises(ValueError, match="max_depth must be >= 1"):
        make_trie(0)


@needs_kernels
def test_the_cpp_trie_refuses_a_frontier_it_does_not_hold():
    """A node index that is not a live node of the trie (another trie's, or one removed since) is a
    ValueError, not a read of whatever the slot holds now; so are token ids C++ cannot hold."""
    trie = NativeSuffixTrie(4)
    other = NativeSuffixTrie(4)
    frontier = other.extend([], list(range(10)))
    with pytest.raises(ValueError, match="not a live node"):
        trie.extend(frontier, [1])
    trie.extend([], [1, 2, 3])
    stale = trie.match_tokens([1, 2])
    trie.retract([1, 2, 3])
    with pytest.raises(ValueError, match="not a live node"):
        trie.draft(stale, 4, 1.0, 0.1, open_frontier=False)
    with pytest.raises(ValueError, match="more than max_depth"):
        trie.match([5] * 5, [1])
    with pytest.raises(ValueError, match="token ids"):
        trie.extend([], [2**31])
    with pytest.raises(ValueError, match="token ids"):
        trie.extend([], [-1])


@needs_kernels
def test_cpp_and_python_tries_agree_on_long_text():
    """A prompt of a few thousand tokens over a small vocabulary (deep, branching tries), outputs added
    and removed: the same counts, and the same draft after every token of a context."""
    import random

    rng = random.Random(0)
    prompt = [rng.randrange(40) for _ in range(3000)]
    outputs = [[rng.randrange(40) for _ in range(300)] for _ in range(5)]
    python, native = SuffixTrie(24), NativeSuffixTrie(24)
    for trie in (python, native):
        for output in outputs:
            trie.extend([], output)
        trie.retract(outputs[1])
        trie.retract(outputs[3])
        trie.extend([], prompt)
    assert native.num_nodes == python.num_nodes
    assert native.substring_counts() == python.substring_counts()
    matched: tuple[Frontier, Frontier] = ([], [])
    for token in prompt[:400]:
        matched = (python.match(matched[0], [token]), native.match(matched[1], [token]))
        assert python.draft(matched[0], 8, 1.0, 0.1, False) == native.draft(matched[1], 8, 1.0, 0.1, False)
