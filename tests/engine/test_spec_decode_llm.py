"""Speculative decoding with the n-gram and suffix proposers, end to end: the same tokens as plain decoding.

Greedy rows take the argmax at every position, seeded rows draw each position's uniform from (seed,
output index) and penalties and min_tokens see the drafts before a position as outputs, so with drafts
a request gets exactly the tokens (and logprobs) it gets without them, in every engine mode. The
model has tied embeddings, so its greedy choice often repeats the last token and the proposer's drafts
hit; penalties then push it off the repeat, so that drafts are rejected too.
"""

from __future__ import annotations

import random

import pytest

from stepahead import LLM, SamplingParams
from tests.engine.test_llm_equivalence import CONFIGS as EQUIVALENCE_CONFIGS
from tests.tiny_models import hf_greedy

MAX_TOKENS = 24
MAX_MODEL_LEN = 128
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    base = [[rng.randrange(3, 2048) for _ in range(n)] for n in (6, 17, 30, 45)]
    # Copies of themselves (drafts hit), a repeat and a shared prefix (the prefix cache hits).
    return [p + p[:10] for p in base] + [base[1] + base[1][:10], base[3][:32] + [9, 10, 11]]


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
SEEDED = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, top_k=20, seed=300 + i) for i in range(len(_prompts()))]
PENALIZED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, presence_penalty=0.3, frequency_penalty=0.2,
                           repetition_penalty=1.1, logprobs=2, min_tokens=MAX_TOKENS)

# Every engine mode of the plain equivalence test that speculation runs in (it turns async outputs off).
CONFIGS = {"async": {}} | {name: overrides for name, overrides in EQUIVALENCE_CONFIGS.items()
                           if not overrides.get("async_output")}


def _tokens_and_logprobs(output) -> tuple[list[int], list[dict[int, float]] | None]:
    completion = output.outputs[0]
    logprobs = None if completion.logprobs is None else \
        [{i: v.logprob for i, v in lp.items()} for lp in completion.logprobs]
    return completion.token_ids, logprobs


def _run(model, **overrides):
    """(greedy, seeded, penalized) outputs as (tokens, logprobs) per prompt, the stats and the config."""
    with LLM(str(model), **(dict(executor="uni", max_model_len=MAX_MODEL_LEN) | overrides)) as llm:
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        results = tuple([_tokens_and_logprobs(o) for o in llm.generate(prompts, params, use_tqdm=False)]
                        for params in (GREEDY, SEEDED, PENALIZED))
        return results, llm.stats(), llm.config


@pytest.fixture(scope="module")
def tied(tiny_model_factory):
    return tiny_model_factory("llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def plain(tied):
    return _run(tied)


def test_plain_matches_transformers(tied, plain):
    assert [tokens for tokens, _ in plain[0][0]] == hf_greedy(tied, _prompts(), MAX_TOKENS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ngram_gives_the_plain_tokens(tied, plain, name):
    results, stats, config = _run(tied, speculative_config=NGRAM, **CONFIGS[name])
    assert config.speculative_config is not None and config.scheduler_config.num_speculative_tokens == 3
    for outputs, base in zip(results, plain[0], strict=True):  # greedy, seeded, penalized with logprobs
        assert [tokens for tokens, _ in outputs] == [tokens for tokens, _ in base]
        for (_, logprobs), (_, base_logprobs) in zip(outputs, base, strict=True):
            if base_logprobs is None:
                assert logprobs is None
                continue
            assert [lp.keys() for lp in logprobs] == [lp.keys() for lp in base_logprobs]
            assert logprobs == [pytest.approx(lp, abs=1e-4) for lp in base_logprobs]
    # Drafts were verified and some accepted, counted per position (a later one only after the earlier).
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    per_pos = stats.spec_accepted_per_pos
    assert len(per_pos) == 3 and per_pos[0] > 0 and per_pos == sorted(per_pos, reverse=True)
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    assert 1 < stats.spec_mean_accepted_length <= 4
    if name.startswith("preempt"):
        assert stats.preemptions > 0
    if name == "no_prefix_cache":
        assert stats.prefix_cache_hits == 0
    else:
        assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize("name", ["async", "sync"])
def test_the_cost_policy_budgets_drafts_and_gives_the_plain_tokens(tied, plain, name, monkeypatch):
    """draft_policy "cost": the worker fits a row's cost from its own decode steps, then each step's
    budget decides the drafts (a spy around the real allocation records it); the tokens are the plain ones."""
    from stepahead.worker.spec_decode import spec_decoder

    budgets = []
    allocate = spec_decoder.allocate_drafts

    def recorded(chances, caps, num_plain_rows, cost):
        counts = allocate(chances, caps, num_plain_rows, cost)
        budgets.append((cost.base, cost.per_row, counts))
        return counts

    monkeypatch.setattr(spec_decoder, "allocate_drafts", recorded)
    results, stats, config = _run(tied, speculative_config=NGRAM | {"draft_policy": "cost"}, **CONFIGS[name])
    assert config.speculative_config.draft_policy == "cost"
    for outputs, base in zip(results, plain[0], strict=True):
        assert [tokens for tokens, _ in outputs] == [tokens for tokens, _ in base]
    assert budgets and all(per_row >= 0 and base >= 0 for base, per_row, _ in budgets)
    assert any(sum(counts) for _, _, counts in budgets)  # the budget drafted, and the drafts were verified
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_drafts_save_steps(tied, plain):
    """One request alone: accepted drafts deliver several tokens a step, so fewer steps run."""
    prompt = [{"prompt_token_ids": _prompts()[0]}]
    steps = {}
    for name, extra in (("plain", {}), ("ngram", dict(speculative_config=NGRAM))):
        with LLM(str(tied), executor="uni", max_model_len=MAX_MODEL_LEN, **extra) as llm:
            (out,) = llm.generate(prompt, GREEDY, use_tqdm=False)
            steps[name] = (llm.stats().forward_steps, out.outputs[0].token_ids)
    assert steps["ngram"][1] == steps["plain"][1] == plain[0][0][0][0]
    assert steps["ngram"][0] < steps["plain"][0]


def test_grammar_requests_draft_beside_others(tied):
    """A grammar request drafts too (each draft position masked as plain decoding masks it) and gets
    its plain output beside a request without a grammar."""
    from stepahead.sampling_params import StructuredOutputsParams

    choices = ["alpha beta gamma", "delta epsilon"]
    params = [SamplingParams(max_tokens=16, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(choice=choices)), GREEDY]
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:2]]
    results = {}
    for name, extra in (("plain", {}), ("ngram", dict(speculative_config=NGRAM))):
        with LLM(str(tied), executor="uni", max_model_len=MAX_MODEL_LEN, **extra) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[name] = ([o.outputs[0].text for o in outs[:1]], [o.outputs[0].token_ids for o in outs])
            stats = llm.stats()
    assert results["ngram"] == results["plain"]
    assert results["ngram"][0][0] in choices
    assert stats.spec_num_accepted_tokens > 0


def test_triton_backend_verifies_as_decode_rows(tied):
    """The CUDA path's attention (through Triton's interpreter here): verifying rows attend as decode
    rows there too, and give the plain tokens."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:2]]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    tokens, accepted = {}, {}
    for name, extra in (("plain", {}), ("ngram", dict(speculative_config=NGRAM))):
        with LLM(str(tied), executor="uni", max_model_len=MAX_MODEL_LEN, attention_backend="triton", **extra) as llm:
            tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            accepted[name] = llm.stats().spec_num_accepted_tokens
    assert tokens["ngram"] == tokens["plain"]
    assert accepted["ngram"] > 0


# -- the suffix proposer: the same tokens, and a repeated answer drafted from the shared cache --

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
SUFFIX_CONFIGS = {name: CONFIGS[name] for name in ("async", "sync", "preempt", "preempt_sync", "chunked", "chunked_sync")}


@pytest.mark.parametrize("name", list(SUFFIX_CONFIGS))
def test_suffix_gives_the_plain_tokens(tied, plain, name):
    results, stats, config = _run(tied, speculative_config=SUFFIX, **SUFFIX_CONFIGS[name])
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
