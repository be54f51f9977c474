"""Speculative decoding with a draft model, end to end: the plain tokens in every engine mode.

The draft is a tiny random model with the target's vocabulary and one layer (its own weights: its
greedy drafts are often rejected, so rollback runs), or the target itself (every greedy draft is
accepted). Greedy requests, and penalized ones with logprobs (whose drafts are greedy), get exactly
their tokens without drafts. Seeded random requests draw their drafts from the draft's q and are
verified by the general rule: another draw of the same distribution, reproducible run to run.
"""

from __future__ import annotations

import pytest

from stepahead import LLM, SamplingParams
from tests.engine.test_spec_decode_llm import CONFIGS, GREEDY, MAX_MODEL_LEN, SEEDED, _prompts, _run
from tests.tiny_models import VOCAB_SIZE, build_tiny_model


def _draft_config(model, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def tied(tiny_model_factory):
    return tiny_model_factory("llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=1, num_hidden_layers=1,
                            tie_word_embeddings=True)


@pytest.fixture(scope="module")
def plain(tied):
    return _run(tied)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_draft_model_gives_the_plain_tokens(tied, small_draft, plain, name):
    results, stats, config = _run(tied, speculative_config=_draft_config(small_draft), **CONFIGS[name])
    assert config.draft_model_config is not None and config.draft_model_config.num_layers == 1
    greedy, seeded, penalized = results
    assert [t for t, _ in greedy] == [t for t, _ in plain[0][0]]
    assert [t for t, _ in penalized] == [t for t, _ in plain[0][2]]
    for (_, logprobs), (_, base_logprobs) in zip(penalized, plain[0][2], strict=True):
        assert logprobs == [pytest.approx(lp, abs=1e-4) for lp in base_logprobs]
    assert [len(t) for t, _ in seeded] == [len(t) for t, _ in plain[0][1]]
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    if name.startswith("preempt"):
        assert stats.preemptions > 0


def test_seeded_requests_reproduce_and_accept_drawn_drafts(tied, small_draft):
    """Seeded random requests with drawn drafts: the same tokens in a second run, and drafts accepted."""
    runs = []
    for _ in range(2):
        with LLM(str(tied), executor="uni", max_model_len=MAX_MODEL_LEN,
                 speculative_config=_draft_config(tied)) as llm:
            prompts = [{"prompt_token_ids": p} for p in _prompts()]
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, SEEDED, use_tqdm=False)])
            stats = llm.stats()
    assert runs[0] == runs[1]
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens


def test_the_target_as_its_own_draft_accepts_every_greedy_draft(tied, plain):
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    with LLM(str(tied), executor="uni", max_model_len=MAX_MODEL_LEN, speculative_config=_draft_config(tied, 4)) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        stats = llm.stats()
    assert tokens == [t for t, _ in plain[0][0]]
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0


def test_a_draft_with_another_vocabulary_is_refused(tied, tmp_path):
    other = build_tiny_model(tmp_path / "wide", "llama", num_hidden_layers=1, vocab_size=VOCAB_SIZE + 64)
    with pytest.raises(ValueError, match=f"vocabulary of {VOCAB_SIZE + 64} tokens, the target model {VOCAB_SIZE}"):
        LLM(str(tied), executor="uni", max_model_len=MAX_MODEL_LEN, speculative_config=_draft_config(other))


def test_draft_model_needs_its_checkpoint_and_one_rank(tied, small_draft):
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(str(tied), executor="uni", speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="draft_model runs on one worker rank; tensor_parallel_size=2 x "
                                         "pipeline_parallel_size=1 is not supported"):
        LLM(str(tied), tensor_parallel_size=2, speculative_config=_draft_config(small_draft))
    with pytest.raises(ValueError, match="draft_model runs on one worker rank; tensor_parallel_size=1 x "
                                         "pipeline_parallel_size=2 is not supported"):
        LLM(str(tied), pipeline_parallel_size=2, speculative_config=_draft_config(small_draft))


def test_triton_backend_runs_the_draft_passes(tied, small_draft):
    """The CUDA path's attention (through Triton's interpreter here) for the target and the draft."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:2]]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    tokens = {}
    for name, extra in (("plain", {}), ("draft", dict(speculative_config=_draft_config(small_draft)))):
        with LLM(str(tied), executor="uni", max_model_len=MAX_MODEL_LEN, attention_backend="triton", **extra) as llm:
            tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = llm.stats()
    assert tokens["draft"] == tokens["plain"]
    assert stats.spec_num_draft_tokens > 0
