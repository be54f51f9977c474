"""The n-gram proposer (vLLM's "ngram" method, prompt lookup): draft the tokens that followed the
latest n tokens where they occurred before in the request's own tokens.

For each request: find the longest n in [prompt_lookup_min, prompt_lookup_max] such that the last n
tokens also occur earlier (a match may overlap the suffix itself), taking the earliest such
occurrence as vLLM does; propose up to k tokens that followed it, never past the known tokens or
max_model_len. Matching is vectorized with numpy over the candidate end positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stepahead.validation import check_field


@dataclass
class NgramProposer:
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    max_model_len: int = 1 << 30

    def __post_init__(self) -> None:
        check_field(self.num_speculative_tokens >= 1, "num_speculative_tokens", self.num_speculative_tokens,
                    "must be >= 1")
        check_field(self.prompt_lookup_min >= 1, "prompt_lookup_min", self.prompt_lookup_min, "must be >= 1")
        check_field(self.prompt_lookup_max >= self.prompt_lookup_min, "prompt_lookup_max", self.prompt_lookup_max,
                    f"must be >= prompt_lookup_min ({self.prompt_lookup_min})")

    def propose(self, token_ids: np.ndarray) -> np.ndarray:
        """Drafts (0..k ids) to follow one request's tokens (prompt and output, a 1-D int array)."""
        tokens = np.asarray(token_ids)
        total = tokens.shape[0]
        k = min(self.num_speculative_tokens, self.max_model_len - total)
        if k <= 0 or total < self.prompt_lookup_min + 1:
            return tokens[:0]
        end, length = self._longest_match(tokens)
        if length < self.prompt_lookup_min:
            return tokens[:0]
        return tokens[end + 1:end + 1 + k]

    def propose_batch(self, token_ids: list[np.ndarray]) -> list[np.ndarray]:
        return [self.propose(t) for t in token_ids]

    def _longest_match(self, tokens: np.ndarray) -> tuple[int, int]:
        """(end, n): the earliest position end <= len-2 where the longest suffix match of n tokens ends."""
        total = tokens.shape[0]
        max_n = min(self.prompt_lookup_max, total - 1)
        ends = np.arange(total - 1)  # a match must be followed by a known token
        # lengths[e] = how many tokens ending at e equal the last ones, up to max_n: the running
        # product of "the m-th token back matches" over m.
        lengths = np.zeros(total - 1, dtype=np.int64)
        alive = np.ones(total - 1, dtype=bool)
        for m in range(max_n):
            back = ends - m
            alive &= back >= 0
            alive[alive] &= tokens[back[alive]] == tokens[total - 1 - m]
            if not alive.any():
                break
            lengths += alive
        best = int(lengths.max())
        return int(np.argmax(lengths == best)), best
