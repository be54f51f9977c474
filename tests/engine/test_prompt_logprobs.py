"""SamplingParams(prompt_logprobs=k): vLLM's shape, equal to a transformers float32 full forward, and
the same whether the prompt was chunked, found in the prefix cache or preempted."""

from __future__ import annotations

import random

import pytest

from stepahead import LLM, SamplingParams
from stepahead.outputs import Logprob
from tests.tiny_models import VOCAB_SIZE, hf_prompt_logprobs

MAX_MODEL_LEN = 128
TOP_K = 4


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in (1, 2, 17, 40, 70)]


PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP_K)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[dict[int, tuple[float, int]] | None]]:
    return hf_prompt_logprobs(tiny_llama, _prompts(), TOP_K)


def _run(model, prompts=None, params=PARAMS, **overrides):
    kwargs = dict(executor="uni", max_model_len=MAX_MODEL_LEN, dtype="float32") | overrides
    with LLM(str(model), **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts or _prompts()], params, use_tqdm=False)
        return outs, llm.stats()


def _assert_matches(outs, reference) -> None:
    for out, ref in zip(outs, reference, strict=True):
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(out.prompt_token_ids) == len(ref)
        assert got[0] is None
        for p in range(1, len(got)):
            entries = got[p]
            assert entries is not None and set(entries) == set(ref[p]), p
            assert all(isinstance(v, Logprob) and v.decoded_token is not None for v in entries.values())
            assert {t: v.rank for t, v in entries.items()} == {t: r for t, (_, r) in ref[p].items()}
            assert {t: v.logprob for t, v in entries.items()} == pytest.approx(
                {t: lp for t, (lp, _) in ref[p].items()}, abs=1e-4)


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    return _run(tiny_llama)


def test_shape_and_values_match_a_full_forward(baseline, reference):
    outs, _ = baseline
    _assert_matches(outs, reference)
    # The prompt token comes first in its dict, then the top-K in rank order.
    entries = outs[3].prompt_logprobs[5]
    prompt_token = outs[3].prompt_token_ids[5]
    assert next(iter(entries)) == prompt_token
    assert all(len(e) in (TOP_K, TOP_K + 1) for e in outs[3].prompt_logprobs[1:])


def test_without_the_field_there_are_none(tiny_llama):
    outs, _ = _run(tiny_llama, prompts=_prompts()[2:3], params=SamplingParams(max_tokens=2, temperature=0.0))
    assert outs[0].prompt_logprobs is None


def test_zero_gives_the_prompt_token_alone(tiny_llama, reference):
    outs, _ = _run(tiny_llama, prompts=_prompts()[2:3],
                   params=SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0))
    got, ref = outs[0].prompt_logprobs, reference[2]
    for p in range(1, len(got)):
        (token_id, value), = got[p].items()
        assert token_id == outs[0].prompt_token_ids[p]
        assert value.logprob == pytest.approx(ref[p][token_id][0], abs=1e-4)


def test_chunked_equals_unchunked(tiny_llama, baseline, reference):
    outs, _ = _run(tiny_llama, max_num_batched_tokens=8)
    _assert_matches(outs, reference)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in baseline[0]]


def test_chunked_sync_equals_unchunked(tiny_llama, reference):
    outs, _ = _run(tiny_llama, max_num_batched_tokens=8, async_scheduling=False)
    _assert_matches(outs, reference)


def test_a_cached_prefix_is_recomputed(tiny_llama, reference):
    """The prompts are in the prefix cache (a first pass without prompt logprobs); the second pass
    asks for them and must compute every position rather than hit the cache."""
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    with LLM(str(tiny_llama), executor="uni", max_model_len=MAX_MODEL_LEN, dtype="float32") as llm:
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        llm.generate(prompts, plain, use_tqdm=False)
        again = llm.generate(prompts, plain, use_tqdm=False)
        hits = llm.stats().prefix_cache_hits
        assert hits > 0 and again[4].num_cached_tokens > 0  # the cache does hold them
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
        assert llm.stats().prefix_cache_hits == hits
    assert all(o.num_cached_tokens == 0 for o in outs)
    _assert_matches(outs, reference)


def test_uncached_equals_cached(tiny_llama, baseline, reference):
    outs, stats = _run(tiny_llama, enable_prefix_caching=False)
    _assert_matches(outs, reference)


@pytest.fixture(scope="module")
def long_outputs(tiny_llama):
    """Long enough outputs that a pool of 9 usable blocks cannot hold the batch: preemptions."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP_K)
    outs, stats = _run(tiny_llama, params=params)
    assert stats.preemptions == 0
    return params, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("is_async", [True, False])
def test_preempted_equals_unpreempted(tiny_llama, long_outputs, reference, is_async):
    params, unpreempted = long_outputs
    outs, stats = _run(tiny_llama, params=params, num_kv_blocks=10, max_num_batched_tokens=16,
                       async_scheduling=is_async)
    assert stats.preemptions > 0
    _assert_matches(outs, reference)
    assert [o.outputs[0].token_ids for o in outs] == unpreempted


def test_n_completions_share_the_prompt_logprobs(tiny_llama, reference):
    outs, _ = _run(tiny_llama, prompts=_prompts()[3:4],
                   params=SamplingParams(n=2, max_tokens=3, temperature=0.7, seed=1, prompt_logprobs=TOP_K))
    _assert_matches(outs, reference[3:4])


def test_out_of_range_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="prompt_logprobs must be -1"):
        SamplingParams(prompt_logprobs=-2)
    with LLM(str(tiny_llama), executor="uni", max_model_len=MAX_MODEL_LEN) as llm:
        for asked, phrase in ((21, "at most 20"), (-1, "at most 20, the engine's max_logprobs; -1 asks for the whole")):
            with pytest.raises(ValueError, match=f"prompt_logprobs must be {phrase}"):
                llm.generate("hello", SamplingParams(prompt_logprobs=asked), use_tqdm=False)
            with pytest.raises(ValueError, match=f"logprobs must be {phrase}"):
                llm.generate("hello", SamplingParams(logprobs=asked), use_tqdm=False)


def test_minus_one_is_the_whole_vocabulary(tiny_llama, reference):
    """With --max-logprobs -1 (no limit), -1 lists every token, ranked, for prompt and sampled tokens."""
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=-1, logprobs=-1)
    outs, _ = _run(tiny_llama, prompts=_prompts()[2:3], params=params, max_logprobs=-1)
    out, ref = outs[0], reference[2]
    for p in range(1, len(out.prompt_logprobs)):
        entries = out.prompt_logprobs[p]
        assert len(entries) == VOCAB_SIZE
        assert sorted(v.rank for v in entries.values()) == list(range(1, VOCAB_SIZE + 1))
        token_id = out.prompt_token_ids[p]
        assert entries[token_id].logprob == pytest.approx(ref[p][token_id][0], abs=1e-4)
    for entries, token_id in zip(out.outputs[0].logprobs, out.outputs[0].token_ids, strict=True):
        assert len(entries) == VOCAB_SIZE and entries[token_id].rank == 1  # greedy: the sampled token ranks first
