"""Sampler features, at the sampler level with crafted logits and end to end through ModelRunner, and the
vectorized sampler checked against the per-row reference in tests/worker/reference_sampler.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import stepahead.worker.sampler as sampler_mod
from stepahead.core.sched_output import GrammarOutput
from stepahead.sampling_params import SamplingParams
from stepahead.worker.model_runner import ModelRunner
from stepahead.worker.sampler import (
    RowSampling,
    SamplingMetadata,
    apply_bitmask,
    apply_bitmask_torch,
    counter_uniforms,
    greedy_ids,
    logprobs_to_host,
    sample,
    sample_rows,
)
from stepahead.worker.sampling_metadata import seed_as_int64
from tests.worker import reference_sampler
from tests.worker.driver import MiniSched, make_config

V = 16


def _row(prompt=(), output=(), stops=(), num_output=-1, **params):
    return RowSampling(SamplingParams(**params), list(prompt), list(output), list(stops), num_output)


def _logits(values: dict[int, float], n=1):
    x = torch.full((n, V), -5.0)
    for t, v in values.items():
        x[:, t] = v
    return x


def test_greedy_and_top_k_1():
    x = _logits({3: 2.0, 4: 1.9})
    tok, _ = sample_rows(x.clone(), [_row(temperature=0.0)])
    assert tok.tolist() == [3]
    toks = {sample_rows(x.clone(), [_row(temperature=1.5, top_k=1)])[0].item() for _ in range(20)}
    assert toks == {3}


@pytest.mark.parametrize("vocab", [128 * 40, 1000])  # through the best chunk, and torch's argmax
def test_greedy_ids_are_torchs_argmax_with_its_ties_and_nans(vocab):
    torch.manual_seed(0)
    x = torch.randn(9, vocab)
    x[1] = 0.0  # all equal: the first
    x[2, [7, 300, vocab - 1]] = 50.0  # equal maxima in three chunks: the first
    x[3, [900, 300]] = float("nan")  # NaNs win, the first of them
    x[4] = float("-inf")
    x[5, 129] = float("inf")
    x[6, vocab - 1] = 99.0  # the last id
    expected = x.argmax(dim=1)
    assert torch.equal(greedy_ids(x), expected)
    assert expected[1] == 0 and expected[2] == 7 and expected[3] == 300


def test_repetition_penalty_changes_choice():
    x = _logits({5: 2.0, 6: 1.5})
    assert sample_rows(x.clone(), [_row(temperature=0.0)])[0].item() == 5
    assert sample_rows(x.clone(), [_row(prompt=[5], temperature=0.0, repetition_penalty=2.0)])[0].item() == 6
    # Repetition also pushes negative logits further down (multiplies).
    y = _logits({5: -1.0, 6: -1.5})
    assert sample_rows(y.clone(), [_row(output=[5], temperature=0.0, repetition_penalty=2.0)])[0].item() == 6


def test_presence_and_frequency_penalties_use_output_only():
    x = _logits({5: 2.0, 6: 1.5})
    assert sample_rows(x.clone(), [_row(output=[5], temperature=0.0, presence_penalty=1.0)])[0].item() == 6
    assert sample_rows(x.clone(), [_row(prompt=[5], temperature=0.0, presence_penalty=1.0)])[0].item() == 5
    assert sample_rows(x.clone(), [_row(output=[5], temperature=0.0, frequency_penalty=0.3)])[0].item() == 5
    assert sample_rows(x.clone(), [_row(output=[5, 5], temperature=0.0, frequency_penalty=0.3)])[0].item() == 6


def _draws(x, n=200, **params):
    torch.manual_seed(0)
    return {sample_rows(x.clone(), [_row(**params)])[0].item() for _ in range(n)}


def test_top_p_min_p_top_k_restrict_support():
    x = _logits({1: 2.0, 2: 1.8, 3: 1.6, 4: 0.5})
    assert {1, 2, 3, 4} <= _draws(x)
    assert _draws(x, top_k=2) == {1, 2}
    assert _draws(x, top_p=0.5) <= {1, 2} and 1 in _draws(x, top_p=0.5)
    # min_p=0.5 keeps tokens with prob >= half the top one: 1, 2 (e^-0.2) and 3 (e^-0.4), not 4.
    assert _draws(x, min_p=0.5) == {1, 2, 3}


def test_min_tokens_suppresses_stop_tokens():
    x = _logits({2: 3.0, 7: 1.0})
    assert sample_rows(x.clone(), [_row(temperature=0.0, stops=[2], min_tokens=2, output=[9])])[0].item() == 7
    assert sample_rows(x.clone(), [_row(temperature=0.0, stops=[2], min_tokens=2, output=[9, 9])])[0].item() == 2


def test_seeded_rows_independent_of_batch():
    x = torch.randn(3, V)
    alone = sample_rows(x[1:2].clone(), [_row(seed=42, temperature=1.0)])[0].item()
    rows = [_row(temperature=1.0), _row(seed=42, temperature=1.0), _row(seed=7, temperature=0.7, top_p=0.9)]
    assert sample_rows(x.clone(), rows)[0][1].item() == alone


def test_logprobs_finite_and_ranked():
    x = _logits({3: 2.0, 4: 1.0})
    apply_bitmask(x, [0], np.array([[(1 << 3) | (1 << 4) | (1 << 9)]], dtype=np.int32))
    _, lps = sample_rows(x, [_row(temperature=0.0, logprobs=5)])
    lp = lps[0]
    assert lp.token_ids[0] == 3 and lp.sampled_rank == 1 and len(lp.token_ids) == 6
    assert lp.token_ids[1:3] == [3, 4]
    assert all(math.isfinite(v) and v <= 0 for v in lp.logprobs)
    assert abs(sum(math.exp(v) for v in lp.logprobs[1:4]) - 1.0) < 1e-5


def test_bitmask_forbids_tokens():
    x = _logits({3: 5.0, 8: 1.0})
    apply_bitmask(x, [0], np.array([[1 << 8]], dtype=np.int32))
    assert sample_rows(x, [_row(temperature=0.0)])[0].item() == 8


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
                      chunk=7)  # "s" has 5 partial-prefill steps that must not advance its draws
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
    freq = torch.bincount(sample_rows(x, rows)[0], minlength=V).float() / 6000
    assert torch.allclose(freq[:3], probs, atol=0.03) and freq[3:].sum() == 0


def test_top_p_wider_than_candidates_falls_back_exactly(monkeypatch):
    monkeypatch.setattr(sampler_mod, "TOP_CANDIDATES", 2)
    x = torch.zeros(1, V)
    x[0, :12] = 1.0  # 12 equally likely tokens hold ~88% of the mass; top_p=0.5 keeps 6 of them
    torch.manual_seed(0)
    drawn = {sample_rows(x.clone(), [_row(temperature=1.0, top_p=0.5)])[0].item() for _ in range(300)}
    assert drawn <= set(range(12)) and len(drawn) > 2  # more than the 2 candidates: the retry ran
    mixed = [_row(temperature=1.0, top_p=0.5), _row(temperature=1.0), _row(temperature=1.0, top_k=3)]
    for _ in range(50):
        toks = sample_rows(x.repeat(3, 1), mixed)[0].tolist()
        assert toks[0] < 12 and toks[2] < 12


# ---- the vectorized sampler against the per-row reference ----

BIG_V = 1000  # wider than the default TOP_CANDIDATES


def _r(temperature=1.0, prompt=(), output=(), stops=(), num_output=-1, **params):
    return _row(prompt, output, stops, num_output, temperature=temperature, **params)


MIXES: dict[str, list[RowSampling]] = {
    "greedy": [_r(0.0), _r(0.0), _r(0.8, top_k=1)],
    "temperature": [_r(0.5), _r(1.0), _r(1.7)],
    "top_k": [_r(top_k=5), _r(0.7, top_k=50), _r(top_k=300), _r(top_k=5000)],  # 5000 >= vocab: off
    "top_p": [_r(top_p=0.5), _r(0.8, top_p=0.9), _r(1.3, top_p=0.99)],
    "top_k_top_p": [_r(top_k=10, top_p=0.8), _r(0.6, top_k=300, top_p=0.95), _r(top_k=40, top_p=0.3)],
    "min_p": [_r(min_p=0.05), _r(0.7, min_p=0.3), _r(min_p=0.1, top_p=0.9), _r(min_p=0.2, top_k=30), _r()],
    "min_tokens": [_r(0.0, stops=[1, 2], min_tokens=3, output=[5]), _r(stops=[3], min_tokens=1, num_output=0),
                   _r(stops=[4], min_tokens=2, output=[6, 6]), _r(top_k=20, stops=[7, 8], min_tokens=4, output=[9])],
    "repetition": [_r(0.0, prompt=[1, 2, 3], output=[4, 4], repetition_penalty=1.7),
                   _r(prompt=[5], output=[6], repetition_penalty=0.6, top_p=0.9), _r(top_k=8)],
    "presence": [_r(0.0, prompt=[1], output=[2, 3, 3], presence_penalty=1.5),
                 _r(output=[4], presence_penalty=-0.7), _r()],
    "frequency": [_r(0.0, output=[2, 3, 3], frequency_penalty=1.2), _r(output=[4, 4, 4], frequency_penalty=-0.4,
                                                                        top_k=30), _r(0.0)],
    "seeds": [_r(seed=1), _r(seed=1, num_output=7), _r(0.7, seed=-5, top_p=0.9), _r(seed=2**70 + 3, top_k=40),
              _r()],
    "logprobs": [_r(0.0, logprobs=0), _r(logprobs=1), _r(0.6, top_p=0.9, logprobs=5), _r(0.0, logprobs=5), _r()],
}
MIXES["mixed"] = [row for rows in MIXES.values() for row in rows][::2] + [_r(0.0, logprobs=3, stops=[0],
                                                                            min_tokens=1, output=[])]
MIXES["all"] = [row for name, rows in MIXES.items() if name != "mixed" for row in rows]


def _num_random(rows: list[RowSampling]) -> int:
    return sum(1 for r in rows if not (r.params.is_greedy or r.params.top_k == 1))


def _compare(rows, logits, seed, candidate_search, bitmask=None):
    """Run the reference and the vectorized sampler on the same logits and uniforms; return both."""
    dev = logits.device
    ref_logits, new_logits = logits.clone(), logits.clone()
    if bitmask is not None:
        reference_sampler.apply_bitmask(ref_logits, list(range(len(rows))), bitmask)
        apply_bitmask(new_logits, list(range(len(rows))), bitmask)
    torch.manual_seed(seed)
    uniforms = torch.rand(_num_random(rows), device=dev)
    ref_tokens, ref_lps = reference_sampler.sample(ref_logits, rows, uniforms)
    md = SamplingMetadata.from_rows(rows, logits.shape[1], dev, candidate_search=candidate_search)
    torch.manual_seed(seed)  # the vectorized sampler draws the same uniforms for its unseeded rows
    out = sample(new_logits, md)
    tokens = out.sampled_token_ids.tolist()
    return (ref_tokens.tolist(), ref_lps), (tokens, logprobs_to_host(out, md, tokens))


def _assert_same(ref, new):
    (ref_tokens, ref_lps), (tokens, lps) = ref, new
    assert tokens == ref_tokens
    assert lps.keys() == ref_lps.keys()
    for row, lp in lps.items():
        assert lp.token_ids == ref_lps[row].token_ids and lp.sampled_rank == ref_lps[row].sampled_rank
        np.testing.assert_allclose(lp.logprobs, ref_lps[row].logprobs, rtol=0, atol=1e-6)


def _trial_logits(n, trial, device="cpu"):
    """Sharp (a few likely tokens) or flat (a nucleus far wider than the candidates) distributions."""
    g = torch.Generator().manual_seed(1000 + trial)
    return (torch.randn(n, BIG_V, generator=g) * (3.0 if trial % 2 == 0 else 0.05)).to(device)


@pytest.mark.parametrize("candidate_search", [True, False], ids=["candidates", "sorted"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_matches_reference(mix, candidate_search):
    rows = MIXES[mix]
    for trial in range(6):
        _assert_same(*_compare(rows, _trial_logits(len(rows), trial), trial, candidate_search))


@pytest.mark.parametrize("candidate_search", [True, False], ids=["candidates", "sorted"])
def test_matches_reference_with_narrow_candidates(monkeypatch, candidate_search):
    """8 candidates: flat rows retry at 128 and then over the whole vocabulary."""
    monkeypatch.setattr(sampler_mod, "TOP_CANDIDATES", 8)
    monkeypatch.setattr(reference_sampler, "TOP_CANDIDATES", 8)
    rows = MIXES["all"]
    for trial in range(6):
        _assert_same(*_compare(rows, _trial_logits(len(rows), trial), trial, candidate_search))


def test_matches_reference_after_bitmask():
    rows = MIXES["all"]
    rng = np.random.default_rng(0)
    words = -(-BIG_V // 32)
    bitmask = rng.integers(-(2**31), 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
    for trial in range(4):
        _assert_same(*_compare(rows, _trial_logits(len(rows), trial), trial, True, bitmask))


def test_candidate_search_retries_spilled_rows():
    """Flat rows with top-p alone spill past the candidates: the CPU path reads that flag back and
    retries, while the sorted path decides its width on the host and reads nothing back."""
    rows = [_r(top_p=0.9), _r(0.0), _r(top_k=20, seed=3), _r(0.0, output=[4], repetition_penalty=1.2, logprobs=2,
                                                            stops=[5], min_tokens=3)]
    x = _trial_logits(len(rows), 1)
    read_back = {"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero"}

    def ops(candidate_search):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            md = SamplingMetadata.from_rows(rows, BIG_V, "cpu", candidate_search=candidate_search)
            sample(x.clone(), md)
        return {e.name for e in prof.events()}

    assert ops(True) & read_back
    assert not ops(False) & read_back


def _ops_with_shapes(rows, x):
    md = SamplingMetadata.from_rows(rows, x.shape[1], "cpu")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        sample(x, md)
    return [(e.name, e.input_shapes) for e in prof.events()]


def test_greedy_rows_never_sort():
    x = _trial_logits(4, 0)
    greedy = [_r(0.0), _r(0.0, repetition_penalty=1.3, prompt=[1], output=[2]), _r(0.0, logprobs=0),
              _r(0.5, top_k=1, stops=[3], min_tokens=2)]
    untruncated = greedy[:2] + [_r(1.0), _r(0.7, min_p=0.1)]
    for rows in (greedy, untruncated):
        names = {name for name, _ in _ops_with_shapes(rows, x.clone())}
        assert not names & {"aten::sort", "aten::topk", "aten::argsort"}
    # A mixed batch sorts only its truncated rows: 1 of 4 here.
    mixed = greedy[:3] + [_r(1.0, top_k=50)]
    shapes = [shape for name, shape in _ops_with_shapes(mixed, x.clone()) if name in ("aten::topk", "aten::sort")]
    assert shapes and all(s[0] == [1, BIG_V] for s in shapes)


def test_seeded_rows_independent_of_batch_composition_and_order():
    seeded = [_r(seed=11, num_output=3), _r(0.8, seed=12, top_p=0.9, num_output=0),
              _r(1.2, seed=13, top_k=40, min_p=0.05, num_output=9)]
    others = [_r(0.0), _r(), _r(top_p=0.5), _r(top_k=500, top_p=0.97), _r(0.0, logprobs=2),
              _r(output=[1], frequency_penalty=0.5)]
    x_seeded = _trial_logits(len(seeded), 0)
    for candidate_search in (True, False):
        alone = [sample(x_seeded[i:i + 1].clone(),
                        SamplingMetadata.from_rows([r], BIG_V, "cpu", candidate_search)).sampled_token_ids.item()
                 for i, r in enumerate(seeded)]
        for trial in range(4):
            g = torch.Generator().manual_seed(trial)
            batch = [(r, x_seeded[i], i) for i, r in enumerate(seeded)]
            batch += [(r, torch.randn(BIG_V, generator=g), None) for r in others[: 2 + trial]]
            order = torch.randperm(len(batch), generator=g).tolist()
            batch = [batch[k] for k in order]
            torch.manual_seed(trial)  # a different global RNG state each time
            md = SamplingMetadata.from_rows([b[0] for b in batch], BIG_V, "cpu", candidate_search)
            tokens = sample(torch.stack([b[1] for b in batch]), md).sampled_token_ids.tolist()
            assert [t for t, b in zip(tokens, batch, strict=True) if b[2] is not None] == \
                [alone[b[2]] for b in batch if b[2] is not None]


def test_seeded_tokens_follow_the_output_index():
    """The draw depends on (seed, outputs so far) only: a resumed request repeats its tokens."""
    x = _trial_logits(1, 1)

    def token(seed, n):
        md = SamplingMetadata.from_rows([_r(seed=seed, num_output=n)], BIG_V, "cpu")
        return sample(x.clone(), md).sampled_token_ids.item()

    run = [token(99, n) for n in range(8)]
    assert [token(99, n) for n in range(8)] == run
    assert len(set(run)) > 1  # flat logits: consecutive outputs draw differently
    assert [token(100, n) for n in range(8)] != run


def test_counter_uniforms_are_pinned_and_uniform():
    seeds = torch.tensor([seed_as_int64(s) for s in (0, 1, 42, -1, 2**64 - 1, 2**40 + 3)])
    counters = torch.tensor([0, 0, 5, 7, 7, 1000])
    # Pinned: changing the hash would change every seeded request's tokens.
    assert (counter_uniforms(seeds, counters) * 2**24).long().tolist() == \
        [9719733, 12159585, 3444633, 7205464, 7205464, 6089701]
    n = 200_000
    for u in (counter_uniforms(torch.full((n,), 12345), torch.arange(n)),  # one request over time
              counter_uniforms(torch.arange(n), torch.zeros(n, dtype=torch.long))):  # many requests, first token
        assert u.min() >= 0 and u.max() < 1
        hist = torch.histc(u, bins=20, min=0, max=1)
        chi2 = ((hist - n / 20) ** 2 / (n / 20)).sum().item()
        assert chi2 < 50  # 19 degrees of freedom: p < 1e-4
        assert abs(torch.corrcoef(torch.stack((u[:-1], u[1:])))[0, 1].item()) < 0.01


def test_bitmask_matches_reference():
    rng = np.random.default_rng(1)
    for vocab, words in ((70, 3), (70, 2), (64, 3)):  # exact, fewer words than the vocabulary needs, more
        x = torch.randn(5, vocab)
        rows = [4, 0, 2]
        mask = rng.integers(-(2**31), 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
        expected = x.clone()
        reference_sampler.apply_bitmask(expected, rows, mask)
        for apply in (apply_bitmask, apply_bitmask_torch):  # xgrammar's kernel, and the path without it
            for r, m in ((rows, mask), (torch.tensor(rows), mask), (rows, torch.from_numpy(mask))):
                got = x.clone()
                apply(got, r, m)
                assert torch.equal(got, expected)
        assert torch.isinf(expected[rows]).any() and torch.equal(expected[[1, 3]], x[[1, 3]])


# ---- the same on a GPU ----

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_counter_uniforms_same_on_cuda():
    seeds = torch.randint(-(2**62), 2**62, (10_000,))
    counters = torch.randint(0, 2**31, (10_000,))
    assert torch.equal(counter_uniforms(seeds, counters), counter_uniforms(seeds.cuda(), counters.cuda()).cpu())


@cuda
@pytest.mark.parametrize("mix", ["top_k_top_p", "min_p", "seeds", "logprobs", "mixed", "all"])
def test_matches_reference_on_cuda(mix):
    rows = MIXES[mix]
    for trial in range(4):
        x = _trial_logits(len(rows), trial, "cuda")
        torch.cuda.set_sync_debug_mode("error")  # the device path must not wait for the GPU
        try:
            md = SamplingMetadata.from_rows(rows, BIG_V, x.device)
            out = sample(x.clone(), md)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _assert_same(*_compare(rows, x, trial, candidate_search=False))
        assert out.sampled_token_ids.device.type == "cuda"
