"""The suffix trie against brute force over random sequences: its counts, its matches and its drafts."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from stepahead.worker.spec.suffix_tree import SuffixNode, SuffixTrie

sequences_st = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=4)


def _substring_counts(sequences: list[list[int]], max_depth: int) -> Counter:
    counts: Counter = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(len(seq), start + max_depth) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def _trie_counts(trie: SuffixTrie) -> Counter:
    counts: Counter = Counter()
    stack: list[tuple[tuple[int, ...], SuffixNode]] = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in (node.children or {}).items():
            assert child.count > 0
            counts[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return counts


def _index(trie: SuffixTrie, seq: list[int]) -> list[SuffixNode]:
    frontier: list[SuffixNode] = []
    for token in seq:
        frontier = trie.extend(frontier, token)
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
def test_own_trie_counts_and_drafts(sequences, depth, k, factor, min_prob):
    """The request's own trie: every sequence indexed, the last one is the context (its end open)."""
    trie = SuffixTrie(depth)
    for seq in sequences[:-1]:
        _index(trie, seq)
    frontier = _index(trie, sequences[-1])
    counts = _substring_counts(sequences, depth)
    assert _trie_counts(trie) == +counts
    assert trie.num_nodes == len(+counts)
    draft = trie.draft(frontier, k, factor, min_prob, open_frontier=True)
    tokens, score = _reference_draft(counts, sequences[-1], True, depth, k, factor, min_prob)
    assert draft.tokens == tokens
    assert abs(draft.score - score) < 1e-9


@settings(max_examples=200, deadline=None)
@given(sequences=sequences_st, retracted=st.sets(st.integers(0, 3)), context=st.lists(st.integers(0, 3), max_size=20),
       depth=st.integers(2, 8), k=st.integers(1, 6), min_prob=st.sampled_from([0.0, 0.1, 0.4]))
def test_shared_trie_retracts_and_matches(sequences, retracted, context, depth, k, min_prob):
    """The shared trie: sequences added then some removed (counts and most frequent children follow);
    a context that is not indexed matches its suffixes found there, incrementally or from scratch."""
    trie = SuffixTrie(depth)
    for seq in sequences:
        _index(trie, seq)
    kept = [seq for i, seq in enumerate(sequences) if i not in retracted]
    for i in sorted(retracted):
        if i < len(sequences):
            trie.retract(sequences[i])
    counts = _substring_counts(kept, depth)
    assert _trie_counts(trie) == +counts
    assert trie.num_nodes == len(+counts)
    matched: list[SuffixNode] = []
    for token in context:
        matched = trie.match(matched, token)
    found = [length for length in range(1, min(len(context), depth) + 1) if counts[tuple(context[-length:])]]
    assert len(matched) == len(found) and found == list(range(1, len(found) + 1))
    assert [node.count for node in matched] == [counts[tuple(context[-n:])] for n in found]
    assert [node.count for node in trie.match_tokens(context)] == [node.count for node in matched]
    draft = trie.draft(matched, k, 1.0, min_prob, open_frontier=False)
    tokens, score = _reference_draft(counts, context, False, depth, k, 1.0, min_prob)
    assert (draft.tokens, round(draft.score, 9)) == (tokens, round(score, 9))


def test_a_longer_match_drafts_longer():
    """max_spec_factor x match length caps the draft: a 2-token match drafts 2 tokens at factor 1."""
    trie = SuffixTrie(16)
    _index(trie, [5, 6, 7, 8, 9, 10, 11])
    context = [1, 6, 7]
    matched = trie.match_tokens(context)
    assert len(matched) == 2
    assert trie.draft(matched, 8, 1.0, 0.1, open_frontier=False).tokens == [8, 9]
    assert trie.draft(matched, 8, 2.0, 0.1, open_frontier=False).tokens == [8, 9, 10, 11]
    assert trie.draft(matched, 3, 2.0, 0.1, open_frontier=False).tokens == [8, 9, 10]


def test_unlikely_continuations_are_cut():
    """After [1, 2] came 3 three times and 4 once: 3 has probability 0.75; 0.8 cuts it."""
    trie = SuffixTrie(8)
    for tail in (3, 3, 3, 4):
        _index(trie, [1, 2, tail])
    matched = trie.match_tokens([1, 2])
    assert trie.draft(matched, 4, 1.0, 0.7, open_frontier=False).tokens == [3]
    assert trie.draft(matched, 4, 1.0, 0.8, open_frontier=False).tokens == []
