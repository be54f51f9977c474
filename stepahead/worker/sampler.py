"""Token sampling for one step: grammar bitmask, min_tokens, penalties, greedy / temperature, top-k,
top-p, min-p, per-request seeds, logprobs.

Sampling draws one exponential variate per vocabulary entry and takes argmax(probs / q) (equivalent to
sampling from probs). A seeded request draws its row with its own torch.Generator, so its tokens do not
depend on what else is in the batch; unseeded rows share one batched draw from the global RNG.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stepahead.core.sched_output import TokenLogprobs
from stepahead.sampling_params import SamplingParams

LOGPROB_FLOOR = -9999.0  # -inf would not survive JSON


@dataclass
class RowSampling:
    """What the sampler needs to know about one row that samples this step."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # may be empty when the row uses no penalties (only its count matters then)
    stop_token_ids: list[int]  # suppressed while fewer than min_tokens outputs exist (eos + stop_token_ids)
    num_output_tokens: int = -1  # -1: len(output_token_ids)

    def __post_init__(self) -> None:
        if self.num_output_tokens < 0:
            self.num_output_tokens = len(self.output_token_ids)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask) -> None:
    """Bit j of word w allows token 32*w + j; every other token of those rows is set to -inf."""
    if bitmask is None or not rows:
        return
    mask = torch.as_tensor(bitmask, dtype=torch.int32).to(logits.device)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((mask.unsqueeze(-1) >> bits) & 1).bool().view(mask.shape[0], -1)
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool, device=logits.device)
        allowed = torch.cat((allowed, pad), dim=1)
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed[: len(rows), :vocab], float("-inf"))


def _apply_min_tokens(logits: torch.Tensor, rows: list[RowSampling]) -> None:
    for i, r in enumerate(rows):
        if r.num_output_tokens < r.params.min_tokens and r.stop_token_ids:
            logits[i, r.stop_token_ids] = float("-inf")


def _apply_penalties(logits: torch.Tensor, rows: list[RowSampling]) -> None:
    """Repetition over prompt + output (divide positive, multiply negative); presence/frequency over output."""
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if not p.uses_penalties:
            continue
        out = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            prompt = torch.tensor(r.prompt_token_ids, dtype=torch.long, device=logits.device)
            seen[prompt] = True
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalized, row))
        if p.frequency_penalty:
            row -= p.frequency_penalty * counts
        if p.presence_penalty:
            row -= p.presence_penalty * (counts > 0).to(logits.dtype)


def _filter(logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on the random rows; returns probabilities."""
    dev = logits.device
    temp = torch.tensor([r.params.temperature for r in rows], device=dev).unsqueeze(1)
    logits = logits / temp
    vocab = logits.shape[1]
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    ps = [r.params.top_p for r in rows]
    if any(k < vocab for k in ks) or any(p < 1.0 for p in ps):
        sorted_logits, order = logits.sort(dim=1, descending=True)
        k = torch.tensor(ks, device=dev).unsqueeze(1)
        kth = sorted_logits.gather(1, k - 1)
        remove_sorted = sorted_logits < kth
        probs_sorted = sorted_logits.masked_fill(remove_sorted, float("-inf")).softmax(dim=1)
        before = probs_sorted.cumsum(dim=1) - probs_sorted  # mass strictly above each token
        p = torch.tensor(ps, device=dev, dtype=logits.dtype).unsqueeze(1)
        remove_sorted |= before > p  # always keeps the top token (before == 0)
        remove = torch.empty_like(remove_sorted).scatter_(1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    probs = logits.softmax(dim=1)
    minp = [r.params.min_p for r in rows]
    if any(m > 0 for m in minp):
        m = torch.tensor(minp, device=dev, dtype=probs.dtype).unsqueeze(1)
        probs = probs.masked_fill(probs < m * probs.max(dim=1, keepdim=True).values, 0.0)
    return probs


def _draw(probs: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    q = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if len(unseeded) == len(rows):
        q.exponential_()
    else:
        for i, r in enumerate(rows):
            if r.generator is not None:
                q[i].exponential_(generator=r.generator)
        if unseeded:
            idx = torch.tensor(unseeded, device=probs.device)
            q[idx] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    return (probs / q).argmax(dim=1)


def sample(logits: torch.Tensor, rows: list[RowSampling]) -> tuple[torch.Tensor, dict[int, TokenLogprobs]]:
    """logits [len(rows), vocab] float32 (modified in place) -> (token ids [len(rows)], {row: logprobs})."""
    _apply_min_tokens(logits, rows)
    want_lp = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_logprobs = logits[want_lp].log_softmax(dim=1) if want_lp else None
    if any(r.params.uses_penalties for r in rows):
        _apply_penalties(logits, rows)
    greedy = [r.params.is_greedy or r.params.top_k == 1 for r in rows]
    tokens = logits.argmax(dim=1)
    rand = [i for i, g in enumerate(greedy) if not g]
    if rand:
        rrows = [rows[i] for i in rand]
        idx = torch.tensor(rand, device=logits.device)
        tokens[idx] = _draw(_filter(logits[idx], rrows), rrows)
    lps: dict[int, TokenLogprobs] = {}
    if want_lp:
        lps = _logprobs(raw_logprobs, tokens[torch.tensor(want_lp, device=logits.device)],
                        [rows[i].params.logprobs for i in want_lp], want_lp)
    return tokens, lps


def _logprobs(lp: torch.Tensor, sampled: torch.Tensor, ns: list[int], row_ids: list[int]) -> dict[int, TokenLogprobs]:
    lp = lp.nan_to_num(nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)
    chosen = lp.gather(1, sampled.unsqueeze(1))
    ranks = (lp > chosen).sum(dim=1) + 1
    top_v, top_i = lp.topk(max(ns), dim=1) if max(ns) > 0 else (lp[:, :0], sampled[:0].unsqueeze(0))
    chosen, ranks, top_v, top_i = chosen.tolist(), ranks.tolist(), top_v.tolist(), top_i.tolist()
    sampled_l = sampled.tolist()
    out = {}
    for j, row in enumerate(row_ids):
        n = ns[j]
        out[row] = TokenLogprobs(token_ids=[sampled_l[j]] + top_i[j][:n] if n else [sampled_l[j]],
                                 logprobs=[chosen[j][0]] + top_v[j][:n] if n else [chosen[j][0]],
                                 sampled_rank=ranks[j])
    return out
