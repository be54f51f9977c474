"""Sampler features, at the sampler level with crafted logits and end to end through ModelRunner."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stepahead.core.sched_output import GrammarOutput
from stepahead.sampling_params import SamplingParams
from stepahead.worker.model_runner import ModelRunner
from stepahead.worker.sampler import RowSampling, apply_bitmask, sample
from tests.worker.driver import MiniSched, make_config

V = 16


def _row(prompt=(), output=(), gen=None, stops=(), **params):
    return RowSampling(SamplingParams(**params), gen, list(prompt), list(output), list(stops))


def _logits(values: dict[int, float], n=1):
    x = torch.full((n, V), -5.0)
    for t, v in values.items():
        x[:, t] = v
    return x


def test_greedy_and_top_k_1():
    x = _logits({3: 2.0, 4: 1.9})
    tok, _ = sample(x.clone(), [_row(temperature=0.0)])
    assert tok.tolist() == [3]
    toks = {sample(x.clone(), [_row(temperature=1.5, top_k=1)])[0].item() for _ in range(20)}
    assert toks == {3}


def test_repetition_penalty_changes_choice():
    x = _logits({5: 2.0, 6: 1.5})
    assert sample(x.clone(), [_row(temperature=0.0)])[0].item() == 5
    assert sample(x.clone(), [_row(prompt=[5], temperature=0.0, repetition_penalty=2.0)])[0].item() == 6
    # Repetition also pushes negative logits further down (multiplies).
    y = _logits({5: -1.0, 6: -1.5})
    assert sample(y.clone(), [_row(output=[5], temperature=0.0, repetition_penalty=2.0)])[0].item() == 6


def test_presence_and_frequency_penalties_use_output_only():
    x = _logits({5: 2.0, 6: 1.5})
    assert sample(x.clone(), [_row(output=[5], temperature=0.0, presence_penalty=1.0)])[0].item() == 6
    assert sample(x.clone(), [_row(prompt=[5], temperature=0.0, presence_penalty=1.0)])[0].item() == 5
    assert sample(x.clone(), [_row(output=[5], temperature=0.0, frequency_penalty=0.3)])[0].item() == 5
    assert sample(x.clone(), [_row(output=[5, 5], temperature=0.0, frequency_penalty=0.3)])[0].item() == 6


def _draws(x, n=200, **params):
    torch.manual_seed(0)
    return {sample(x.clone(), [_row(**params)])[0].item() for _ in range(n)}


def test_top_p_min_p_top_k_restrict_support():
    x = _logits({1: 2.0, 2: 1.8, 3: 1.6, 4: 0.5})
    assert {1, 2, 3, 4} <= _draws(x)
    assert _draws(x, top_k=2) == {1, 2}
    assert _draws(x, top_p=0.5) <= {1, 2} and 1 in _draws(x, top_p=0.5)
    # min_p=0.5 keeps tokens with prob >= half the top one: 1, 2 (e^-0.2) and 3 (e^-0.4), not 4.
    assert _draws(x, min_p=0.5) == {1, 2, 3}


def test_min_tokens_suppresses_stop_tokens():
    x = _logits({2: 3.0, 7: 1.0})
    assert sample(x.clone(), [_row(temperature=0.0, stops=[2], min_tokens=2, output=[9])])[0].item() == 7
    assert sample(x.clone(), [_row(temperature=0.0, stops=[2], min_tokens=2, output=[9, 9])])[0].item() == 2


def test_seeded_rows_independent_of_batch():
    x = torch.randn(3, V)
    alone = sample(x[1:2].clone(), [_row(gen=torch.Generator().manual_seed(42), temperature=1.0)])[0].item()
    rows = [_row(temperature=1.0), _row(gen=torch.Generator().manual_seed(42), temperature=1.0),
            _row(gen=torch.Generator().manual_seed(7), temperature=0.7, top_p=0.9)]
    assert sample(x.clone(), rows)[0][1].item() == alone


def test_logprobs_finite_and_ranked():
    x = _logits({3: 2.0, 4: 1.0})
    apply_bitmask(x, [0], np.array([[(1 << 3) | (1 << 4) | (1 << 9)]], dtype=np.int32))
    _, lps = sample(x, [_row(temperature=0.0, logprobs=5)])
    lp = lps[0]
    assert lp.token_ids[0] == 3 and lp.sampled_rank == 1 and len(lp.token_ids) == 6
    assert lp.token_ids[1:3] == [3, 4]
    assert all(math.isfinite(v) and v <= 0 for v in lp.logprobs)
    assert abs(sum(math.exp(v) for v in lp.logprobs[1:4]) - 1.0) < 1e-5


def test_bitmask_forbids_tokens():
    x = _logits({3: 5.0, 8: 1.0})
    apply_bitmask(x, [0], np.array([[1 << 8]], dtype=np.int32))
    assert sample(x, [_row(temperature=0.0)])[0].item() == 8


# ---- end to end through the runner ----

@pytest.fixture(scope="module")
def runner_factory(tiny_model_factory):
    folder = tiny_model_factory("llama")
    return lambda: ModelRunner(make_config(folder, block_size=16))


PROMPT = list(range(100, 140))


def _generate(runner_factory, reqs, chunk=10**9, max_new=6):
    sched = MiniSched(runner_factory(), 16, chunk=chunk)
    for rid, prompt, params in reqs:
        sched.add(rid, prompt, max_new, params)
    return sched.run()


def test_seeded_reproducible_across_batches_and_chunking(runner_factory):
    p = SamplingParams(temperature=1.0, seed=123, max_tokens=6)
    alone = _generate(runner_factory, [("s", PROMPT, p)])["s"]
    mixed = _generate(runner_factory, [("x", PROMPT[:9], SamplingParams(temperature=1.0, max_tokens=6)),
                                       ("s", PROMPT, p),
                                       ("y", PROMPT[5:30], SamplingParams(temperature=0.8, seed=5, max_tokens=6))],
                      chunk=7)  # "s" has 5 partial-prefill steps that must not advance its generator
    assert mixed["s"] == alone
    other_seed = _generate(runner_factory, [("s", PROMPT, SamplingParams(temperature=1.0, seed=124))])["s"]
    assert other_seed != alone


def test_penalties_change_runner_output(runner_factory):
    greedy = SamplingParams(temperature=0.0)
    base = _generate(runner_factory, [("g", PROMPT, greedy)], max_new=12)["g"]
    pen = _generate(runner_factory, [("g", PROMPT, SamplingParams(temperature=0.0, repetition_penalty=1.8,
                                                                  frequency_penalty=1.5))], max_new=12)["g"]
    assert pen != base


def test_runner_bitmask_and_logprobs(runner_factory):
    runner = runner_factory()
    sched = MiniSched(runner, 16)
    sched.add("a", PROMPT, 1, SamplingParams(temperature=0.0, logprobs=3))
    sched.add("b", PROMPT[:20], 1, SamplingParams(temperature=0.0))
    words = -(-runner.vocab_size // 32)
    mask = np.zeros((1, words), dtype=np.int32)
    mask[0, 777 // 32] = 1 << (777 % 32)
    # Reuse the driver's output construction, but intercept sample_tokens to supply the bitmask.
    orig = runner.sample_tokens
    runner.sample_tokens = lambda _g: orig(GrammarOutput(["b"], mask))
    out = sched.step()
    by_id = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
    assert by_id["b"] == [777]
    lp = out.logprobs["a"][0]
    assert lp.token_ids[0] == by_id["a"][0] and lp.sampled_rank == 1 and len(lp.token_ids) == 4
    assert "b" not in out.logprobs


def test_sampling_frequencies_follow_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.2])
    x = torch.full((6000, V), float("-inf"))
    x[:, :3] = probs.log()
    torch.manual_seed(0)
    rows = [_row(temperature=1.0) for _ in range(6000)]
    freq = torch.bincount(sample(x, rows)[0], minlength=V).float() / 6000
    assert torch.allclose(freq[:3], probs, atol=0.03) and freq[3:].sum() == 0


def test_top_p_wider_than_candidates_falls_back_exactly(monkeypatch):
    import stepahead.worker.sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "TOP_CANDIDATES", 2)
    x = torch.zeros(1, V)
    x[0, :12] = 1.0  # 12 equally likely tokens hold ~88% of the mass; top_p=0.5 keeps 6 of them
    torch.manual_seed(0)
    drawn = {sample(x.clone(), [_row(temperature=1.0, top_p=0.5)])[0].item() for _ in range(300)}
    assert drawn <= set(range(12)) and len(drawn) > 2  # more than the 2 candidates: the retry ran
    mixed = [_row(temperature=1.0, top_p=0.5), _row(temperature=1.0), _row(temperature=1.0, top_k=3)]
    for _ in range(50):
        toks = sample(x.repeat(3, 1), mixed)[0].tolist()
        assert toks[0] < 12 and toks[2] < 12
