"""The suffix proposer (vLLM's "suffix" method, after Arctic Inference's suffix decoding): drafts from
counted suffix tries over the request's own tokens and over the outputs of recent other requests.

Each request indexes its prompt and verified outputs in its own trie (`worker/spec_decode/suffix_tree.py`),
a few nodes per new token. The outputs of finished requests go into one global trie shared by all
requests, the latest `suffix_decoding_max_cached_requests` of them (the oldest leaves first), so an
agent or code-edit loop that repeats an earlier answer drafts it. For every length L of the request's
latest tokens found in a trie, the candidate draft follows the most frequent continuation while its
estimated probability (the product of the steps' frequencies) stays >= `suffix_decoding_min_token_prob`,
at most `suffix_decoding_max_spec_factor` x L tokens (a longer match earns a longer draft), capped by
num_speculative_tokens and by the trie's depth (`suffix_decoding_max_tree_depth` bounds match plus
draft); the candidate with the highest summed probability is proposed.

Memory: a trie holds up to max_tree_depth nodes per indexed token (fewer where text repeats). The tries
are C++ (worker/spec_decode/cpu_suffix_trie.py) wherever stepahead's CPU kernels build, else Python's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from stepahead.config import SpeculativeConfig
from stepahead.worker.request_state import CachedRequestState
from stepahead.worker.spec_decode import cpu_suffix_trie
from stepahead.worker.spec_decode.proposer import ProposedDrafts, Proposer
from stepahead.worker.spec_decode.suffix_tree import Frontier, SuffixIndex, SuffixTrie


def new_suffix_trie(max_depth: int) -> SuffixIndex:
    """An empty trie: C++ where the CPU kernels are built (any machine with an AVX2 CPU and a compiler,
    a CUDA one too: the proposer runs on the host), Python's otherwise."""
    if cpu_suffix_trie.available():
        return cpu_suffix_trie.NativeSuffixTrie(max_depth)
    return SuffixTrie(max_depth)


@dataclass
class RequestIndex:
    """One running request's view: its own trie, and where its latest tokens sit in the global one."""

    trie: SuffixIndex
    resets: int  # the request's DraftTrack.resets when this index was built (a resume rebuilds it)
    num_indexed: int = 0
    frontier: Frontier = field(default_factory=list)  # in its own trie
    matched: Frontier = field(default_factory=list)  # in the global trie
    matched_version: int = -1  # the global trie's version the match was taken at


class SuffixProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 make_trie: Callable[[int], SuffixIndex] = new_suffix_trie) -> None:
        """make_trie: an empty trie of a given depth (A/B runs and tests pick the implementation)."""
        self.make_trie = make_trie
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_tree_depth = config.suffix_decoding_max_tree_depth
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.max_model_len = max_model_len
        self.global_trie = make_trie(self.max_tree_depth)
        self.global_version = 0  # bumped whenever the global trie changes (matches are then retaken)
        self.cached_outputs: OrderedDict[str, list[int]] = OrderedDict()  # oldest first
        self.requests: dict[str, RequestIndex] = {}

    def propose(self, states: list[CachedRequestState], max_drafts: list[int]) -> ProposedDrafts:
        return ProposedDrafts([self.draft_for(state.req_id, state.token_ids, state.draft.resets)[:n]
                               for state, n in zip(states, max_drafts, strict=True)])

    def finish(self, state: CachedRequestState) -> None:
        self.cache_output(state.req_id, state.output_token_ids)

    def draft_for(self, req_id: str, token_ids: list[int], resets: int) -> list[int]:
        """Drafts (0..k ids) to follow one request's tokens (prompt and verified output)."""
        index = self._index(req_id, token_ids, resets)
        k = min(self.num_speculative_tokens, self.max_model_len - len(token_ids))
        if k <= 0:
            return []
        own = index.trie.draft(index.frontier, k, self.max_spec_factor, self.min_token_prob, open_frontier=True)
        if not index.matched:
            return own.tokens
        shared = self.global_trie.draft(index.matched, k, self.max_spec_factor, self.min_token_prob,
                                        open_frontier=False)
        return shared.tokens if shared.score > own.score else own.tokens

    def cache_output(self, req_id: str, output_token_ids: list[int]) -> None:
        """The request finished: forget its index, and cache its output for the requests that follow."""
        self.requests.pop(req_id, None)
        if self.max_cached_requests == 0 or not output_token_ids:
            return
        if req_id in self.cached_outputs:  # an id used again replaces its older output
            self.global_trie.retract(self.cached_outputs.pop(req_id))
        self.global_trie.extend([], output_token_ids)
        self.cached_outputs[req_id] = list(output_token_ids)
        while len(self.cached_outputs) > self.max_cached_requests:
            _, oldest = self.cached_outputs.popitem(last=False)
            self.global_trie.retract(oldest)
        self.global_version += 1

    def _index(self, req_id: str, token_ids: list[int], resets: int) -> RequestIndex:
        """The request's index, caught up with its tokens: O(depth) per token not yet seen."""
        index = self.requests.get(req_id)
        if index is None or index.resets != resets or index.num_indexed > len(token_ids):
            # New, or resumed after a preemption (tokens the worker had may have been dropped).
            index = self.requests[req_id] = RequestIndex(self.make_trie(self.max_tree_depth), resets)
        in_step = index.matched_version == self.global_version
        new_tokens = token_ids[index.num_indexed:]
        index.frontier = index.trie.extend(index.frontier, new_tokens)
        if in_step:
            index.matched = self.global_trie.match(index.matched, new_tokens)
        index.num_indexed = len(token_ids)
        if not in_step:
            index.matched = self.global_trie.match_tokens(token_ids)
            index.matched_version = self.global_version
        return index
