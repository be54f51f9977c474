"""The per-row sampler the vectorized one in stepahead/worker/sampler.py replaced, kept as its reference.

Its behaviour is the previous implementation's, with two changes so both consume the same uniforms:
a seeded row's uniform is `counter_uniforms(seed, num_output_tokens)` (not a draw from a per-request
torch.Generator), and the unseeded rows' uniforms can be supplied (`unseeded_uniforms`, one per
non-greedy row in batch order) instead of drawn from the global RNG. RowSampling is the engine's.
"""

from __future__ import annotations

import torch

from stepahead.core.sched_output import TokenLogprobs
from stepahead.outputs import LOGPROB_FLOOR
from stepahead.worker.sampler import counter_uniforms
from stepahead.worker.sampling_metadata import RowSampling, seed_as_int64

TOP_CANDIDATES = 256  # top-k/top-p rows sample among this many best tokens unless the nucleus is wider


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


def _min_p(probs: torch.Tensor, rows: list[RowSampling], top: torch.Tensor) -> torch.Tensor:
    minp = [r.params.min_p for r in rows]
    if not any(m > 0 for m in minp):
        return probs
    m = torch.tensor(minp, device=probs.device, dtype=probs.dtype).unsqueeze(1)
    return probs.masked_fill(probs < m * top, 0.0)


def _uniforms(rows: list[RowSampling], device, unseeded: torch.Tensor | None) -> torch.Tensor:
    """One uniform per row: seeded rows from their (seed, output index) counter, the rest from
    `unseeded` when given, else from the global RNG."""
    u = torch.rand(len(rows), device=device) if unseeded is None else unseeded.to(device).clone()
    for i, r in enumerate(rows):
        if r.params.seed is not None:
            seed = torch.tensor([seed_as_int64(r.params.seed)], device=device)
            u[i] = counter_uniforms(seed, torch.tensor([r.num_output_tokens], device=device))[0]
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row's (unnormalized, non-negative) probabilities with uniforms u."""
    c = probs.cumsum(dim=1)
    t = (u * c[:, -1]).unsqueeze(1)
    return torch.searchsorted(c, t, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _sample_truncated(x: torch.Tensor, rows: list[RowSampling], u: torch.Tensor,
                      num_candidates: int | None = None) -> torch.Tensor:
    """Rows with top-k and/or top-p: work on the top candidates only (a sort of the whole vocabulary
    costs hundreds of ms at batch 64 on CPU). Exact: rows whose nucleus could reach past the
    candidates retry with 16x more, and finally with the whole vocabulary."""
    dev, vocab = x.device, x.shape[1]
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows]
    k_cand = min(vocab, max(num_candidates or TOP_CANDIDATES, max(ks)))
    vals, idx = x.topk(k_cand, dim=1)
    has_k = torch.tensor([k > 0 for k in ks], device=dev)
    kt = torch.tensor([k or k_cand for k in ks], device=dev)
    vals = vals.masked_fill(torch.arange(k_cand, device=dev).unsqueeze(0) >= kt.unsqueeze(1), float("-inf"))
    # Normalizer: over the kept top-k, or over the whole vocabulary for rows with top-p only.
    lse = vals.logsumexp(dim=1)
    if not all(ks):
        lse = torch.where(has_k, lse, x.logsumexp(dim=1))
    probs = (vals - lse.unsqueeze(1)).exp()
    p = torch.tensor([r.params.top_p for r in rows], device=dev, dtype=x.dtype).unsqueeze(1)
    spill = (~has_k) & (probs.sum(dim=1) <= p.squeeze(1))  # the next token past the candidates is kept too
    probs = probs.masked_fill(probs.cumsum(dim=1) - probs > p, 0.0)
    probs = _min_p(probs, rows, probs[:, :1])
    tokens = idx.gather(1, _inverse_cdf(probs, u).unsqueeze(1)).squeeze(1)
    if k_cand < vocab and bool(spill.any()):
        sp = spill.nonzero().squeeze(1)
        tokens[sp] = _sample_truncated(x[sp], [rows[i] for i in sp.tolist()], u[sp], 16 * k_cand)
    return tokens


def _sample_random(logits: torch.Tensor, rows: list[RowSampling],
                   unseeded: torch.Tensor | None) -> torch.Tensor:
    dev, vocab = logits.device, logits.shape[1]
    x = logits / torch.tensor([r.params.temperature for r in rows], device=dev).unsqueeze(1)
    u = _uniforms(rows, dev, unseeded)
    trunc = [i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab or r.params.top_p < 1.0]
    if not trunc:
        return _sample_random_full(x, rows, u)
    if len(trunc) == len(rows):
        return _sample_truncated(x, rows, u)
    tokens = torch.empty(len(rows), dtype=torch.long, device=dev)
    in_trunc = set(trunc)
    full = [i for i in range(len(rows)) if i not in in_trunc]
    for sel, fn in ((trunc, _sample_truncated), (full, _sample_random_full)):
        ix = torch.tensor(sel, device=dev)
        tokens[ix] = fn(x[ix], [rows[i] for i in sel], u[ix])
    return tokens


def _sample_random_full(x: torch.Tensor, rows: list[RowSampling], u: torch.Tensor) -> torch.Tensor:
    probs = (x - x.max(dim=1, keepdim=True).values).exp_()  # unnormalized; the top token has 1
    return _inverse_cdf(_min_p(probs, rows, 1.0), u)


def sample(logits: torch.Tensor, rows: list[RowSampling],
           unseeded_uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, TokenLogprobs]]:
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
        idx = torch.tensor(rand, device=logits.device)
        tokens[idx] = _sample_random(logits[idx] if len(rand) < len(rows) else logits, [rows[i] for i in rand],
                                     unseeded_uniforms)
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
