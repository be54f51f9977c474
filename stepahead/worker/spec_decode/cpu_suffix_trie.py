"""Suffix decoding's trie in C++ (kernels/suffix_trie.cpp): the SuffixTrie of worker/spec_decode/suffix_tree.py
with its nodes in one vector, named by index, and their children in one table keyed by (parent, token).

The proposer indexes every prompt token at up to max_tree_depth nodes; in Python objects that is some
270 bytes and over a microsecond a node (more as the garbage collector walks them), which a long
prompt pays at its first step. In C++ it is some 65 bytes and under 0.1 µs (docs/BENCHMARKS.md §18.3).
A frontier is a list of node indices; a trie checks every index it is handed (a stale or foreign one
is a ValueError, never a wrong read).
"""

from __future__ import annotations

from collections.abc import Sequence

from stepahead.kernels import cpu_build
from stepahead.worker.spec_decode.suffix_tree import Draft, Frontier


def available() -> bool:
    """Whether the C++ trie can be used in this process (the CPU kernels built; cpu_build.py)."""
    return cpu_build.available()


class NativeSuffixTrie:
    """A SuffixIndex (worker/spec_decode/suffix_tree.py) over the C++ trie."""

    def __init__(self, max_depth: int) -> None:
        self._trie = cpu_build.op("SuffixTrie")(max_depth)
        self.max_depth = max_depth

    @property
    def num_nodes(self) -> int:
        return self._trie.num_nodes

    def extend(self, frontier: Frontier, tokens: Sequence[int]) -> Frontier:
        return self._trie.extend(frontier, tokens)

    def retract(self, tokens: Sequence[int]) -> None:
        self._trie.retract(tokens)

    def match(self, frontier: Frontier, tokens: Sequence[int]) -> Frontier:
        return self._trie.match(frontier, tokens)

    def match_tokens(self, tokens: Sequence[int]) -> Frontier:
        return self._trie.match_tokens(tokens[-self.max_depth:])  # converts only what it reads

    def draft(self, frontier: Frontier, max_tokens: int, max_spec_factor: float, min_token_prob: float,
              open_frontier: bool) -> Draft:
        tokens, score, match_len = self._trie.draft(frontier, max_tokens, max_spec_factor, min_token_prob,
                                                    open_frontier)
        return Draft(tokens, score, match_len)

    def count(self, node: int) -> int:
        return self._trie.count(node)

    def substring_counts(self) -> dict[tuple[int, ...], int]:
        return {tuple(path): count for path, count in self._trie.substring_counts()}

    def memory_bytes(self) -> int:
        """The bytes its storage holds (its vectors' capacity)."""
        return self._trie.memory_bytes()
