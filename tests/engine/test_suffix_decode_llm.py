"""Speculative decoding with the suffix proposer, end to end: the same tokens as plain decoding in every
engine mode, and a request that repeats an earlier request's output drafts it from the shared cache."""

from __future__ import annotations

import pytest

from stepahead import LLM, SamplingParams
from tests.engine.test_spec_decode_llm import CONFIGS as SPEC_CONFIGS
from tests.engine.test_spec_decode_llm import MAX_MODEL_LEN, _prompts, _run

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
CONFIGS = {name: SPEC_CONFIGS[name] for name in ("async", "sync", "preempt", "preempt_sync", "chunked", "chunked_sync")}


@pytest.fixture(scope="module")
def tied(tiny_model_factory):
    return tiny_model_factory("llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def plain(tied):
    return _run(tied)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_suffix_gives_the_plain_tokens(tied, plain, name):
    results, stats, config = _run(tied, speculative_config=SUFFIX, **CONFIGS[name])
    assert config.speculative_config is not None and config.speculative_config.method == "suffix"
    for outputs, base in zip(results, plain[0], strict=True):  # greedy, seeded, penalized with logprobs
        assert [tokens for tokens, _ in outputs] == [tokens for tokens, _ in base]
        for (_, logprobs), (_, base_logprobs) in zip(outputs, base, strict=True):
            if base_logprobs is not None:
                assert logprobs == [pytest.approx(lp, abs=1e-4) for lp in base_logprobs]
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    if name.startswith("preempt"):
        assert stats.preemptions > 0


def _repeat_drafting(model, max_cached_requests: int) -> tuple[list[int], list[int], int, int]:
    """The same prompt sent twice, one request after the other, as an agent loop repeats itself:
    (first output, second output, the second's drafted and accepted tokens)."""
    prompt = [{"prompt_token_ids": _prompts()[2]}]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    spec = SUFFIX | {"suffix_decoding_max_cached_requests": max_cached_requests}
    with LLM(str(model), executor="uni", max_model_len=MAX_MODEL_LEN, speculative_config=spec) as llm:
        (first,) = llm.generate(prompt, params, use_tqdm=False)
        before = llm.stats()
        (second,) = llm.generate(prompt, params, use_tqdm=False)
        after = llm.stats()
    return (first.outputs[0].token_ids, second.outputs[0].token_ids,
            after.spec_num_draft_tokens - before.spec_num_draft_tokens,
            after.spec_num_accepted_tokens - before.spec_num_accepted_tokens)


def test_a_repeated_output_drafts_from_the_shared_cache(tiny_llama):
    """A model whose output seldom repeats itself: the second request drafts its output from the first's
    in the shared cache, with high acceptance; without the cache it drafts little."""
    first, second, drafted, accepted = _repeat_drafting(tiny_llama, 16)
    assert second == first
    _, _, drafted_alone, accepted_alone = _repeat_drafting(tiny_llama, 0)
    # Drafts grow with the match (max_spec_factor 1: one draft after one matched token), so the first
    # few steps deliver fewer tokens.
    assert accepted >= 0.7 * (len(second) - 1) and accepted >= 0.8 * drafted
    assert accepted_alone < accepted / 2
