"""A depth-bounded suffix trie with occurrence counts: suffix decoding's index of past tokens.

Every substring of length <= max_depth of the sequences added is a path from the root, and a node's
count is how many times its substring occurs in them. Appending one token to a sequence touches only
the nodes of the substrings that end at it, one per length: the sequence's *frontier* (frontier[d-1]
is the node of its last d tokens), so indexing costs O(max_depth) per token, and removing a sequence
replays the same walk with -1. The same walk without creating nodes keeps, for a sequence that is
not in the trie, the nodes of its suffixes that are (`match`): every substring of a substring in the
trie is in it, so those are the suffixes of lengths 1..m for the longest matched m.

Each node remembers its most frequent child (kept up to date as counts rise, rescanned after one
falls), so walking the likeliest continuation costs O(1) a token.

The proposer runs the same trie in C++ (kernels/suffix_trie.cpp, through worker/spec_decode/cpu_suffix_trie.py)
wherever stepahead's CPU kernels build: some 65 bytes a node instead of some 270, and no Python per
token. This one, of Python objects, is the fallback where they do not (no AVX2 CPU or no compiler, or
STEPAHEAD_DISABLE_CPU_KERNELS set), and the reference: tests/worker/spec_decode/test_suffix_tree.py checks
both against brute force. Both follow `SuffixIndex`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

NO_TOKEN = -1

# A sequence's frontier: the trie's own handles to its nodes (SuffixNode objects here, node indices in
# C++), valid for that trie only, and in the shared trie only until it next changes.
Frontier = list[Any]


class SuffixNode:
    __slots__ = ("best", "children", "count")

    def __init__(self) -> None:
        self.count = 0  # occurrences of this node's substring
        self.children: dict[int, SuffixNode] | None = None
        self.best = NO_TOKEN  # the child with the highest count; NO_TOKEN: none, or unknown after a decrement

    def best_child(self) -> tuple[int, SuffixNode] | None:
        """(token, node) of the most frequent continuation, the smallest id among equals."""
        if not self.children:
            return None
        if self.best == NO_TOKEN:
            self.best = max(self.children.items(), key=lambda item: (item[1].count, -item[0]))[0]
        return self.best, self.children[self.best]


@dataclass
class Draft:
    """A proposal: its tokens, and how it scores (the sum of the tokens' estimated probabilities)."""

    tokens: list[int]
    score: float = 0.0
    match_len: int = 0


class SuffixIndex(Protocol):
    """What the proposer calls on a trie, in Python (SuffixTrie) or in C++ (cpu_suffix_trie.NativeSuffixTrie)."""

    @property
    def max_depth(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    def extend(self, frontier: Frontier, tokens: Sequence[int]) -> Frontier: ...

    def retract(self, tokens: Sequence[int]) -> None: ...

    def match(self, frontier: Frontier, tokens: Sequence[int]) -> Frontier: ...

    def match_tokens(self, tokens: Sequence[int]) -> Frontier: ...

    def draft(self, frontier: Frontier, max_tokens: int, max_spec_factor: float, min_token_prob: float,
              open_frontier: bool) -> Draft: ...

    def count(self, node: Any) -> int: ...

    def substring_counts(self) -> dict[tuple[int, ...], int]: ...


class SuffixTrie:
    """The trie of Python objects: the fallback and the reference (the module's docstring says when)."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"suffix trie max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = SuffixNode()
        self.num_nodes = 0

    def extend(self, frontier: Frontier, tokens: Sequence[int]) -> Frontier:
        """Index `tokens` appended to the sequence whose frontier is given (empty: a new sequence);
        returns its new frontier."""
        for token in tokens:
            new = [self._add(self.root, token)]
            for node in frontier[:self.max_depth - 1]:
                new.append(self._add(node, token))
            frontier = new
        return frontier

    def retract(self, tokens: Sequence[int]) -> None:
        """Remove a sequence indexed earlier (its substrings' counts drop; nodes left at 0 go)."""
        frontier: list[SuffixNode] = []
        for token in tokens:
            new = [self._remove(self.root, token)]
            for node in frontier[:self.max_depth - 1]:
                new.append(self._remove(node, token))
            frontier = new

    def match(self, frontier: Frontier, tokens: Sequence[int]) -> Frontier:
        """The frontier of a sequence that is not indexed here, after `tokens`: the nodes of its suffixes
        found in the trie (lengths 1..m), creating nothing."""
        for token in tokens:
            frontier = self._match_one(frontier, token)
        return frontier

    def match_tokens(self, tokens: Sequence[int]) -> Frontier:
        """The matched frontier of the last max_depth tokens, from scratch."""
        return self.match([], tokens[-self.max_depth:])

    def count(self, node: SuffixNode) -> int:
        return node.count

    def substring_counts(self) -> dict[tuple[int, ...], int]:
        """Every indexed substring with its count, for checks."""
        counts: dict[tuple[int, ...], int] = {}
        stack: list[tuple[tuple[int, ...], SuffixNode]] = [((), self.root)]
        while stack:
            path, node = stack.pop()
            for token, child in (node.children or {}).items():
                counts[path + (token,)] = child.count
                stack.append((path + (token,), child))
        return counts

    def draft(self, frontier: Frontier, max_tokens: int, max_spec_factor: float, min_token_prob: float,
              open_frontier: bool) -> Draft:
        """The likeliest continuation of the sequence whose (matched) frontier is given, over every match
        length: from the node of its last L tokens, follow the most frequent child while the product of
        the steps' frequencies stays >= min_token_prob, at most min(max_tokens, max_spec_factor * L)
        tokens (and the trie's depth). The highest total probability wins.

        open_frontier: the frontier is the sequence's own, indexed here: each of its nodes counts one
        occurrence (the sequence's end) that has no continuation yet, left out of the frequencies."""
        best = Draft([])
        for length in range(len(frontier), 0, -1):
            # A draft scores at most its length; this cap only shrinks as the match does (the depth's grows).
            cap = min(max_tokens, int(max_spec_factor * length))
            if cap <= best.score:
                break
            budget = min(cap, self.max_depth - length)
            node = frontier[length - 1]
            tokens: list[int] = []
            prob, score = 1.0, 0.0
            depth = length
            while len(tokens) < budget:
                picked = node.best_child()
                if picked is None:
                    break
                token, child = picked
                total = node.count - (1 if open_frontier and depth <= len(frontier) and
                                      frontier[depth - 1] is node else 0)
                if total <= 0:
                    break
                prob *= child.count / total
                if prob < min_token_prob:
                    break
                tokens.append(token)
                score += prob
                node, depth = child, depth + 1
            if score > best.score:
                best = Draft(tokens, score, length)
        return best

    def _match_one(self, frontier: Frontier, token: int) -> Frontier:
        children = self.root.children
        first = children.get(token) if children else None
        if first is None:
            return []
        new = [first]
        for node in frontier[:self.max_depth - 1]:
            child = node.children.get(token) if node.children else None
            if child is None:
                break
            new.append(child)
        return new

    def _add(self, parent: SuffixNode, token: int) -> SuffixNode:
        if parent.children is None:
            parent.children = {}
        child = parent.children.get(token)
        if child is None:
            child = parent.children[token] = SuffixNode()
            self.num_nodes += 1
        child.count += 1
        if parent.best == NO_TOKEN:
            if len(parent.children) == 1:  # else unknown after a decrement: rescanned when needed
                parent.best = token
        elif parent.best != token:
            best = parent.children[parent.best]
            if (child.count, -token) > (best.count, -parent.best):
                parent.best = token
        return child

    def _remove(self, parent: SuffixNode, token: int) -> SuffixNode:
        assert parent.children is not None
        child = parent.children[token]
        child.count -= 1
        if parent.best == token:
            parent.best = NO_TOKEN  # rescanned when next needed
        if child.count == 0:
            del parent.children[token]
            self.num_nodes -= 1
        return child
