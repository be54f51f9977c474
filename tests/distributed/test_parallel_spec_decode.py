"""Speculative decoding on tensor- and pipeline-parallel ranks (gloo, CPU) gives the tokens one rank
gives without drafts.

Only the sampler rank verifies and proposes; every other rank takes each step's outcome (verified
tokens and next drafts, worker/spec_decode/step_outcome.py) from its broadcast and lays out the same drafts,
so a rank whose token lists, computed counts or drafts drifted from the sampler's would compute other
tokens (or fail its layout check). The model has tied embeddings and the prompts copy themselves, so
the proposers' drafts hit, and the counters must show accepted drafts. Greedy decoding of this model
repeats the last token, which is also what a rank pads missing drafts with; penalties push it off the
repeat, so those drafts are other tokens, and the suffix proposer's drafts of a batch run a second
time are the first run's outputs.
"""

from __future__ import annotations

import pytest

from stepahead import LLM, SamplingParams
from tests.engine.test_spec_decode_llm import NGRAM, _prompts

MAX_MODEL_LEN = 128
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
PENALIZED = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.1, presence_penalty=0.3,
                           frequency_penalty=0.2)
SEEDED = [SamplingParams(max_tokens=24, temperature=0.7, top_k=20, seed=300 + i) for i in range(len(_prompts()))]

CONFIGS = {
    "tp2_ngram": dict(tensor_parallel_size=2, speculative_config=NGRAM),  # async, depth 2
    "tp2_suffix": dict(tensor_parallel_size=2, speculative_config=SUFFIX),
    "tp2_sync_ngram": dict(tensor_parallel_size=2, async_scheduling=False, speculative_config=NGRAM),
    "pp2_ngram": dict(pipeline_parallel_size=2, speculative_config=NGRAM),  # async, depth 3
    "pp2_sync_ngram": dict(pipeline_parallel_size=2, async_scheduling=False, speculative_config=NGRAM),
    "pp2_suffix": dict(pipeline_parallel_size=2, speculative_config=SUFFIX),
    # A pool too small for every request: preempted requests resume with their drafts dropped on every rank.
    "pp2_preempt_ngram": dict(pipeline_parallel_size=2, num_kv_blocks=10, speculative_config=NGRAM),
    "tp2_pp2_suffix": dict(tensor_parallel_size=2, pipeline_parallel_size=2, speculative_config=SUFFIX),  # 4 ranks
}


def _tokens(llm: LLM, params) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tied(tiny_model_factory):
    return tiny_model_factory("llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def one_rank_plain(tied):
    """(greedy, penalized, seeded) tokens on one rank without drafts."""
    with LLM(str(tied), executor="uni", max_model_len=MAX_MODEL_LEN) as llm:
        return _tokens(llm, GREEDY), _tokens(llm, PENALIZED), _tokens(llm, SEEDED)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parallel_drafts_give_the_plain_tokens(tied, one_rank_plain, name):
    greedy, penalized, seeded = one_rank_plain
    with LLM(str(tied), max_model_len=MAX_MODEL_LEN, **CONFIGS[name]) as llm:
        assert _tokens(llm, GREEDY) == greedy
        before = llm.stats().spec_num_accepted_tokens
        assert _tokens(llm, PENALIZED) == penalized
        if "suffix" in name:  # drafted from the first run's outputs, now in the shared trie
            assert _tokens(llm, PENALIZED) == penalized
        assert llm.stats().spec_num_accepted_tokens > before
        if name != "tp2_pp2_suffix":  # four ranks on the build machine's cores: no seeded run
            assert _tokens(llm, SEEDED) == seeded
        stats = llm.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    if "preempt" in name:
        assert stats.preemptions > 0


def test_ray_ranks_share_the_drafts(local_ray_cluster, tied, one_rank_plain):
    """The Ray executor hosts the same runner: its sampler's outcomes reach the other actor."""
    _, penalized, _ = one_rank_plain
    with LLM(str(tied), max_model_len=MAX_MODEL_LEN, tensor_parallel_size=2, distributed_executor_backend="ray",
             speculative_config=SUFFIX) as llm:
        assert llm.config.executor == "ray"
        assert _tokens(llm, PENALIZED) == penalized
        assert _tokens(llm, PENALIZED) == penalized  # drafted from the first run's outputs
        assert llm.stats().spec_num_accepted_tokens > 0
