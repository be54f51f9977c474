"""Every sampling rule holds at draft positions: random combinations of sampling options give the same
outputs with drafts as without.

Each request draws its own mix of options (greedy or seeded random with top-k/top-p/min-p, penalties,
min_tokens, stop tokens, logit bias, allowed tokens, logprobs) from a seeded generator, so an option
added later joins the draw by one line. Bad words and stop strings are then cut from what the request
writes without them, so each one changes the plain output. Rules that read the output history (bad
words, penalties) must see the drafts before each draft position, and a stop string completed in the
middle of a step's tokens must end the output where plain decoding ends it.

Two models: a random one with tied embeddings, whose greedy choice often repeats the last token (drafts
hit, and penalties and bad words push it off the repeat, so drafts are rejected too); and a scripted one
that continues a cycle of tokens its prompts already hold, so the proposers draft several tokens of the
very words that are banned. A draft model's seeded random rows are verified by the general rule
(another draw of the same distribution), so for it only the greedy requests must match exactly. One
rank and two pipeline stages, sync and async, with preemption: the rules live on the sampling rank.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from stepahead import LLM, SamplingParams
from stepahead.outputs import EngineStats
from tests.engine.test_spec_decode_llm import NGRAM, SUFFIX
from tests.tiny_models import build_scripted_model

MAX_TOKENS = 20
MAX_MODEL_LEN = 128
NUM_REQUESTS = 24
CYCLE = list(range(300, 312))  # the scripted model's greedy text: 300, 301, ..., 311, 300, ...


def _copying_prompts() -> list[list[int]]:
    rng = random.Random(11)
    base = [[rng.randrange(3, 2048) for _ in range(rng.randrange(5, 30))] for _ in range(NUM_REQUESTS)]
    return [p + p[:8] for p in base]


def _cycle_prompts() -> list[list[int]]:
    """Stretches of the cycle longer than it, so the continuation is already in the prompt."""
    rng = random.Random(12)
    return [[CYCLE[(start + i) % len(CYCLE)] for i in range(rng.randrange(len(CYCLE) + 2, 40))]
            for start in (rng.randrange(len(CYCLE)) for _ in range(NUM_REQUESTS))]


@dataclasses.dataclass(frozen=True)
class Case:
    folder: str
    prompts: list[list[int]]


@pytest.fixture(scope="module", params=["tied", "cycle"])
def case(request, tiny_model_factory, tmp_path_factory) -> Case:
    if request.param == "tied":
        return Case(str(tiny_model_factory("llama", tie_word_embeddings=True)), _copying_prompts())
    successors = {a: CYCLE[(i + 1) % len(CYCLE)] for i, a in enumerate(CYCLE)}
    return Case(str(build_scripted_model(tmp_path_factory.mktemp("cycle"), successors)), _cycle_prompts())


def _random_params(rng: random.Random, prompt: list[int]) -> SamplingParams:
    """One request's draw of sampling options (each option on for part of the requests)."""
    opts: dict = dict(max_tokens=MAX_TOKENS, temperature=0.0)
    if rng.random() < 0.5:
        opts.update(temperature=rng.choice([0.6, 1.0]), seed=rng.randrange(1 << 30),
                    top_k=rng.choice([0, 5, 40]), top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]))
    if rng.random() < 0.3:
        opts.update(presence_penalty=rng.choice([0.0, 0.4]), frequency_penalty=rng.choice([0.0, 0.3]),
                    repetition_penalty=rng.choice([1.0, 1.2]))
    if rng.random() < 0.3:
        opts.update(min_tokens=rng.randrange(1, MAX_TOKENS))
    if rng.random() < 0.2:
        opts.update(stop_token_ids=[rng.choice(prompt)])
    if rng.random() < 0.2:
        opts.update(logit_bias={rng.choice(prompt): rng.choice([-3.0, 2.0])})
    if rng.random() < 0.1:
        opts.update(allowed_token_ids=sorted(set(prompt)))
    if rng.random() < 0.2:
        opts.update(logprobs=2)
    return SamplingParams(**opts)


def _with_words(rng: random.Random, params: SamplingParams, written: list[int], text: str) -> SamplingParams:
    """Bad words and a stop string out of what the request wrote without them: words of one to three of
    its tokens (from its second on, where drafts propose them), and a piece of its text."""
    words = []
    if rng.random() < 0.6 and len(written) > 3:
        for _ in range(rng.randrange(1, 3)):
            n = rng.choice([1, 2, 2, 3, 3])
            start = rng.randrange(1, len(written) - n + 1)
            words.append(written[start:start + n])
    stop = []
    if rng.random() < 0.3 and len(text) > 8:
        start = rng.randrange(2, len(text) - 4)
        stop = [text[start:start + rng.randrange(2, 5)]]
    return dataclasses.replace(params, bad_words_token_ids=words or None, stop=stop)


def _generate(case: Case, params: list[SamplingParams], **engine) -> tuple[list[tuple], EngineStats]:
    """Per request (greedy?, token ids, text, finish reason, stop reason, logprobs), and the stats."""
    with LLM(case.folder, **(dict(executor="uni", max_model_len=MAX_MODEL_LEN) | engine)) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in case.prompts], params, use_tqdm=False)
        stats = llm.stats()
    results = []
    for out, p in zip(outs, params, strict=True):
        c = out.outputs[0]
        logprobs = None if c.logprobs is None else [{i: v.logprob for i, v in lp.items()} for lp in c.logprobs]
        results.append((p.is_greedy, c.token_ids, c.text, c.finish_reason, c.stop_reason, logprobs))
    return results, stats


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


@pytest.fixture(scope="module")
def free(case):
    """The drawn options without bad words and stop strings, and what plain decoding writes under them."""
    rng = random.Random(5)
    params = [_random_params(rng, p) for p in case.prompts]
    return params, _generate(case, params)[0]


@pytest.fixture(scope="module")
def params(free):
    rng = random.Random(6)
    return [_with_words(rng, p, out[1], out[2]) for p, out in zip(*free, strict=True)]


@pytest.fixture(scope="module")
def plain(case, params):
    return _generate(case, params)[0]


def test_the_draw_exercises_the_rules(free, params, plain):
    """Each bad word is one the request wrote without it, and plain decoding avoids them all; stop
    strings end some outputs; some requests are greedy, others seeded."""
    written = free[1]
    banned = [(i, word) for i, p in enumerate(params) for word in p.bad_words_token_ids or []]
    assert len(banned) >= 8 and all(_contains(written[i][1], word) for i, word in banned)
    assert not [i for i, word in banned if _contains(plain[i][1], word)]
    assert sum(reason == "stop" and isinstance(stop, str) for _, _, _, reason, stop, _ in plain) >= 2
    assert any(greedy for greedy, *_ in plain) and not all(greedy for greedy, *_ in plain)


DRAFTED = {
    "ngram_async": dict(speculative_config=NGRAM),
    "ngram_sync": dict(speculative_config=NGRAM, async_scheduling=False),
    "suffix_async": dict(speculative_config=SUFFIX),
    "ngram_preempt": dict(speculative_config=NGRAM, num_kv_blocks=12),
    # Two pipeline stages in their own processes: the last samples, verifies and proposes.
    "pp2_ngram": dict(speculative_config=NGRAM, pipeline_parallel_size=2, executor="mp"),
}


def _check_equal(drafted: list[tuple], plain: list[tuple], random_rows_exact: bool = True) -> None:
    for i, (got, want) in enumerate(zip(drafted, plain, strict=True)):
        greedy, tokens, text, reason, stop, logprobs = got
        if not (greedy or random_rows_exact):
            continue
        assert (tokens, text, reason, stop) == want[1:5], f"request {i}"
        if want[5] is not None:
            assert logprobs == [pytest.approx(lp, abs=1e-4) for lp in want[5]], f"request {i}"


@pytest.mark.parametrize("name", list(DRAFTED))
def test_drafts_keep_every_sampling_rule(case, params, plain, name):
    if name == "pp2_ngram" and case.prompts != _cycle_prompts():
        pytest.skip("two stages run once, on the model whose drafts propose the banned words")
    drafted, stats = _generate(case, params, **DRAFTED[name])
    _check_equal(drafted, plain)
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert stats.preemptions > 0 or "preempt" not in name


def test_draft_model_keeps_every_sampling_rule(case, params, plain):
    drafted, stats = _generate(case, params, speculative_config={"method": "draft_model", "model": case.folder,
                                                                 "num_speculative_tokens": 3})
    _check_equal(drafted, plain, random_rows_exact=False)
    assert stats.spec_num_accepted_tokens > 0
