"""logit_bias and allowed_token_ids in the vectorized sampler: crafted logits, mixed batches."""

from __future__ import annotations

import math

import torch

from stepahead.sampling_params import SamplingParams
from stepahead.worker.sampler import RowSampling, sample_rows

V = 16


def _row(**params) -> RowSampling:
    return RowSampling(SamplingParams(**params), [], [], [])


def _logits(values: dict[int, float], n: int = 1) -> torch.Tensor:
    x = torch.full((n, V), -5.0)
    for t, v in values.items():
        x[:, t] = v
    return x


def test_logit_bias_forces_and_bans_greedy_tokens():
    x = _logits({3: 2.0, 4: 1.0}, n=4)
    rows = [_row(temperature=0.0), _row(temperature=0.0, logit_bias={9: 100.0}),
            _row(temperature=0.0, logit_bias={3: -100.0}), _row(temperature=0.0, logit_bias={4: 0.6, 3: -0.5})]
    tokens, _ = sample_rows(x, rows)
    assert tokens.tolist() == [3, 9, 4, 4]


def test_logit_bias_leaves_the_input_and_the_raw_logprobs_alone():
    x = _logits({3: 2.0, 4: 1.0})
    before = x.clone()
    tokens, lps = sample_rows(x, [_row(temperature=0.0, logprobs=1, logit_bias={4: 5.0})])
    assert tokens.tolist() == [4]
    assert torch.equal(x, before)  # sampling the row again (after a batch failure) gives the same token
    assert lps[0].token_ids == [4, 3] and lps[0].sampled_rank == 2  # vLLM's raw logprobs: before the bias


def test_logit_bias_applies_to_random_rows():
    x = _logits({3: 2.0, 4: 1.0}, n=2)
    rows = [_row(temperature=1.0, seed=s, logit_bias={11: 100.0}) for s in (1, 2)]
    assert sample_rows(x, rows)[0].tolist() == [11, 11]


def test_allowed_token_ids_restrict_greedy_random_and_logprobs():
    x = _logits({3: 2.0, 4: 1.0}, n=3)
    rows = [_row(temperature=0.0, allowed_token_ids=[5, 7], logit_bias={7: 1.0}),
            _row(temperature=1.0, seed=3, allowed_token_ids=[12]),
            _row(temperature=0.0, logprobs=2, allowed_token_ids=[4, 6])]
    tokens, lps = sample_rows(x, rows)
    assert tokens.tolist() == [7, 12, 4]
    assert lps[2].token_ids[:3] == [4, 4, 6]
    assert math.isclose(sum(math.exp(v) for v in lps[2].logprobs[1:]), 1.0, rel_tol=1e-5)
    for _ in range(20):
        draw = sample_rows(_logits({3: 2.0}), [_row(temperature=1.5, allowed_token_ids=[1, 2])])[0].item()
        assert draw in (1, 2)
