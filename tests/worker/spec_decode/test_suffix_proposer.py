"""The suffix proposer: drafts from the request's own tokens, from finished requests' outputs (the
oldest evicted first), and an index that follows a resumed request's tokens; over either trie."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stepahead.config import SpeculativeConfig
from stepahead.kernels import cpu_build
from stepahead.worker.spec_decode import cpu_suffix_trie
from stepahead.worker.spec_decode.suffix_proposer import SuffixProposer, new_suffix_trie
from stepahead.worker.spec_decode.suffix_tree import SuffixTrie

needs_kernels = pytest.mark.skipif(not cpu_build.machine_can_build(), reason="needs an AVX2 CPU and a C++ compiler")


@pytest.fixture(params=[SuffixTrie, pytest.param(cpu_suffix_trie.NativeSuffixTrie, marks=needs_kernels)],
                ids=["python", "cpp"])
def make_trie(request):
    return request.param


@pytest.fixture
def _proposer(make_trie):
    def build(**suffix) -> SuffixProposer:
        return SuffixProposer(SpeculativeConfig("suffix", 8, **suffix), max_model_len=1000, make_trie=make_trie)
    return build


ANSWER = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]


def test_own_tokens_draft_a_repeat(_proposer):
    proposer = _proposer()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # The request has begun repeating its prompt: four matched tokens allow four drafts (factor 1).
    assert proposer.draft_for("a", prompt + [1, 2, 3, 4], 0) == [5, 6, 7, 8]
    # Six matched tokens: the prompt's end, then the repeat so far again.
    assert proposer.draft_for("a", prompt + [1, 2, 3, 4, 5, 6], 0) == [7, 8, 9, 1, 2, 3]
    assert proposer.draft_for("b", [1, 2, 3], 0) == []


def test_finished_outputs_draft_for_later_requests_and_the_oldest_leave(_proposer):
    proposer = _proposer(suffix_decoding_max_cached_requests=2)
    proposer.draft_for("first", [7, 7] + ANSWER, 0)
    proposer.cache_output("first", ANSWER)
    assert "first" not in proposer.requests
    # Another request whose output has begun like the first's drafts its continuation.
    assert proposer.draft_for("second", [9, 9, 40, 41, 42], 0) == [43, 44, 45]
    assert proposer.draft_for("second", [9, 9, 40, 41, 42, 43, 44, 45], 0) == [46, 47, 48, 49]
    proposer.cache_output("other1", [1, 1, 1])
    proposer.cache_output("other2", [2, 2, 2])  # two cached at most: the first's output leaves
    assert list(proposer.cached_outputs) == ["other1", "other2"]
    assert proposer.draft_for("third", [9, 9, 40, 41, 42], 0) == []
    assert proposer.global_trie.num_nodes == len({(1,), (1, 1), (1, 1, 1), (2,), (2, 2), (2, 2, 2)})


def test_no_cache_keeps_nothing(_proposer):
    proposer = _proposer(suffix_decoding_max_cached_requests=0)
    proposer.cache_output("first", ANSWER)
    assert proposer.global_trie.num_nodes == 0
    assert proposer.draft_for("second", [9, 40, 41, 42], 0) == []


def test_a_resumed_request_is_indexed_again(_proposer):
    """Preempted and resumed, the worker's tokens may have lost a tail it had indexed: the index is
    rebuilt from the tokens as they now are."""
    proposer = _proposer()
    proposer.draft_for("a", [1, 2, 3, 9, 1, 2], 0)
    assert proposer.draft_for("a", [1, 2, 3, 9, 1, 2], 0) == [3, 9]
    # The tail [9, 1, 2] was dropped at the preemption and the request went on with [5, 1, 2].
    assert proposer.draft_for("a", [1, 2, 3, 5, 1, 2], 1) == [3, 5]


def test_max_model_len_caps_drafts(make_trie):
    proposer = SuffixProposer(SpeculativeConfig("suffix", 8), max_model_len=14, make_trie=make_trie)
    assert proposer.draft_for("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4], 0) == [5]


@pytest.mark.parametrize("key,value", [("suffix_decoding_max_tree_depth", 1),
                                       ("suffix_decoding_max_cached_requests", -1),
                                       ("suffix_decoding_max_spec_factor", 0),
                                       ("suffix_decoding_min_token_prob", 1.5)])
def test_bad_settings_are_named(key, value):
    with pytest.raises(ValueError, match=key):
        SpeculativeConfig.from_user({"method": "suffix", "num_speculative_tokens": 4, key: value})


@needs_kernels
def test_the_proposer_runs_the_cpp_trie_where_the_kernels_build():
    assert cpu_suffix_trie.available()
    assert isinstance(new_suffix_trie(24), cpu_suffix_trie.NativeSuffixTrie)
    assert isinstance(SuffixProposer(SpeculativeConfig("suffix", 4), 100).global_trie, cpu_suffix_trie.NativeSuffixTrie)


def test_the_proposer_falls_back_to_the_python_trie_without_the_kernels():
    """With the kernels switched off (as where they cannot build), a process's proposer runs Python's trie."""
    code = ("from stepahead.worker.spec_decode.suffix_proposer import new_suffix_trie; "
            "print(type(new_suffix_trie(24)).__module__)")
    env = {**os.environ, cpu_build.DISABLE_ENV: "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == SuffixTrie.__module__
