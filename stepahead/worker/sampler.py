"""Token sampling for one step, vectorized over the batch: grammar bitmask, allowed_token_ids,
min_tokens, logit_bias, penalties, greedy / temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Design. The host describes the step once (`SamplingMetadata.from_rows`: numpy, one host-to-device
copy) and decides every branch from the parameters: all greedy, any penalties, which rows are
truncated, how many logprobs. `sample` then runs a fixed sequence of batched tensor ops with no
per-row Python loop and, on the GPU path, nothing read back to the host, so the sampled ids stay on
the device (the next step can feed them as inputs) and the number of launches per step does not grow
with the batch. `logprobs_to_host` does the host conversion once the ids have been copied anyway.

- Greedy rows take an argmax and nothing else; an all-greedy step never reaches the random path, and
  in a mixed step only the random rows are gathered into it.
- Random rows sample by inverse CDF with one uniform each. Unseeded rows share one batched draw from
  the global torch RNG. A seeded row's uniform is a hash of (seed, number of outputs so far) computed
  on the device (`counter_uniforms`), so its tokens depend neither on the rest of the batch nor on
  how often it was scheduled, and replay identically after preemption.
- Rows with top-k/top-p sample in probability order among their best tokens. With
  `candidate_search` (CPU) that is the top TOP_CANDIDATES tokens, and rows whose nucleus could
  reach past them retry with 16x more (a host read, free on CPU; a full sort costs hundreds of ms at
  batch 64 there). Without it (CUDA) the width is fixed from the parameters: the largest top-k, or
  the whole vocabulary sorted when a row has top-p alone. Both give the same token for the same
  uniform up to float rounding; rows without truncation sample over the vocabulary in id order.
- Logprobs are taken after the masks (bitmask, allowed_token_ids, min_tokens), before logit_bias,
  penalties and temperature (vLLM's raw logprobs), with -inf floored at LOGPROB_FLOOR.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from stepahead.core.sched_output import TokenLogprobs
from stepahead.outputs import LOGPROB_FLOOR
from stepahead.worker.sampling_metadata import RowSampling, SamplingMetadata

__all__ = ["RowSampling", "SamplerOutput", "SamplingMetadata", "apply_bitmask", "apply_bitmask_torch", "counter_uniforms",
           "greedy_ids", "logprobs_to_host", "sample", "sample_rows", "sampling_probs"]

TOP_CANDIDATES = 256  # with candidate_search, top-k/top-p rows sample among this many unless wider
_MASK32 = 0xFFFFFFFF


@dataclass
class SamplerOutput:
    """What `sample` leaves on the device. The logprob tensors cover metadata.logprob_rows, in order."""

    sampled_token_ids: torch.Tensor  # [rows] int64
    sampled_logprobs: torch.Tensor | None = None  # [L] float32: the sampled token's logprob
    sampled_ranks: torch.Tensor | None = None  # [L] int64: its 1-based rank in the distribution
    top_token_ids: torch.Tensor | None = None  # [L, max_num_logprobs] int64
    top_logprobs: torch.Tensor | None = None  # [L, max_num_logprobs] float32


# ---- seeded uniforms ----

def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x in [0, 2**32), in int64 without overflow (16-bit halves of c), so the
    result is exact and identical on every device."""
    lo = x * (c & 0xFFFF)
    hi = (x * (c >> 16)) & 0xFFFF
    return (lo + (hi << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (xor-shift-multiply, "lowbias32" constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1), a pure function of (seed, counter): int64 seeds (seed_as_int64) and
    non-negative int64 counters (the row's output index), elementwise."""
    h = _mix32((seeds & _MASK32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seeds >> 32) & _MASK32))
    h = _mix32(h ^ (counters & _MASK32))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))  # 24 bits: exact in float32


def _random_uniforms(md: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """One uniform per random row: counter-based for seeded rows, one global-RNG draw for the rest."""
    if not md.any_seeded:
        return torch.rand(md.num_random, device=device)
    seeded = counter_uniforms(md.seeds, md.output_index)
    if not md.any_unseeded:
        return seeded
    return torch.where(md.seeded, seeded, torch.rand(md.num_random, device=device))


# ---- greedy ----

GREEDY_CHUNK = 128  # logits per chunk when greedy_ids looks for the best chunk first


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=1), the first of equal maxima and the first NaN as torch's: on CPU through
    the first chunk of GREEDY_CHUNK logits holding the row's maximum (or a NaN), since torch's CPU
    argmax over a large vocabulary costs many times what amax does."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab % GREEDY_CHUNK or rows == 0:
        return logits.argmax(dim=1)
    chunk_max = logits.reshape(rows, vocab // GREEDY_CHUNK, GREEDY_CHUNK).amax(-1)  # NaN where a chunk has one
    top = chunk_max.amax(-1, keepdim=True)
    holds = (chunk_max == top) | chunk_max.isnan()
    first = holds.byte().argmax(-1)  # the first chunk holding the maximum, or the first NaN
    columns = first.unsqueeze(1) * GREEDY_CHUNK + torch.arange(GREEDY_CHUNK, device=logits.device)
    return columns.gather(1, logits.gather(1, columns).argmax(-1, keepdim=True)).squeeze(1)


# ---- logits processing ----

def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor | list[int],
                  bitmask: np.ndarray | torch.Tensor | None) -> None:
    """Bit j of word w of bitmask[i] allows token 32*w + j of row rows[i]; every other token of those
    rows (also any the bitmask has no bit for) is set to -inf. bitmask: int32 [len(rows), words]
    (extra rows ignored), numpy or tensor. xgrammar's kernel (C++ on CPU, CUDA on GPU) when it is
    installed, else torch."""
    if bitmask is None or len(rows) == 0:
        return
    kernel = _xgrammar_kernel()
    if kernel is None:
        apply_bitmask_torch(logits, rows, bitmask)
        return
    # The kernel reads row r of the mask for logits row r: lay the masks out by logits row, one word
    # per 32 tokens of the vocabulary (missing words allow nothing).
    rows = torch.as_tensor(rows).tolist() if isinstance(rows, torch.Tensor) else list(rows)
    host = bitmask.cpu().numpy() if isinstance(bitmask, torch.Tensor) else np.asarray(bitmask, dtype=np.int32)
    num_words = (logits.shape[1] + 31) // 32
    full = np.zeros((logits.shape[0], num_words), dtype=np.int32)
    width = min(num_words, host.shape[1])
    full[rows, :width] = host[:len(rows), :width]
    kernel(logits, _to_device(full, logits.device), vocab_size=logits.shape[1], indices=rows)


@functools.cache
def _xgrammar_kernel() -> Callable | None:
    try:
        import xgrammar
    except ImportError:
        return None
    return xgrammar.apply_token_bitmask_inplace


def apply_bitmask_torch(logits: torch.Tensor, rows: torch.Tensor | list[int],
                        bitmask: np.ndarray | torch.Tensor) -> None:
    """apply_bitmask in plain torch: the path without xgrammar."""
    dev, vocab, n = logits.device, logits.shape[1], len(rows)
    if isinstance(rows, torch.Tensor) or isinstance(bitmask, torch.Tensor):
        idx = torch.as_tensor(rows).to(dev, torch.int64)
        words = bitmask[:n].to(dev, torch.int32) if isinstance(bitmask, torch.Tensor) else \
            _to_device(np.asarray(bitmask, dtype=np.int32)[:n], dev)
    else:  # one copy: the row index rides along as an extra int32 column
        host = np.concatenate((np.asarray(rows, dtype=np.int32)[:, None], np.asarray(bitmask, dtype=np.int32)[:n]),
                              axis=1)
        both = _to_device(host, dev)
        idx, words = both[:, 0].long(), both[:, 1:]
    bits = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool().view(n, -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill_(~allowed[:, :vocab], float("-inf")))


def _to_device(host: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(host))
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _apply_min_tokens(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Suppress the stop tokens of rows below min_tokens, except in a row where that would leave no
    token at all: a grammar that is complete allows only the end tokens, and the grammar wins there
    (the request then ends with its grammar, short of min_tokens), as in vLLM."""
    rows, tokens = md.stop_rows, md.stop_tokens
    kept = logits[rows, tokens]
    logits.index_put_((rows, tokens), logits.new_full((), float("-inf")))
    emptied = torch.isneginf(logits.amax(dim=1)).index_select(0, rows)
    logits.index_put_((rows, tokens), torch.where(emptied, kept, float("-inf")))


def _apply_allowed(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """-inf for every token outside a restricted row's allowed_token_ids (a mask, like the grammar's)."""
    rows = md.allowed_rows
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~md.allowed_mask, float("-inf")))


def _biased(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The logits plus each row's logit_bias, in a new tensor (the input stays as the model gave it)."""
    return logits.index_put((md.bias_rows, md.bias_tokens), md.bias_values, accumulate=True)


def _penalized(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The logits with penalties applied, in a new tensor (sampling a row again gives the same result):
    repetition over prompt + output (divide positive logits, multiply negative ones); presence/frequency
    over the output only. Neutral values leave a row's logits bit-identical."""
    all_rows = md.penalty_rows.shape[0] == md.num_rows
    x = logits if all_rows else logits.index_select(0, md.penalty_rows)
    counts = md.output_counts
    if md.prompt_mask is not None:
        seen = md.prompt_mask | (counts > 0)
        rep = md.repetition_penalty.unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - md.frequency_penalty.unsqueeze(1) * counts
    x = x - md.presence_penalty.unsqueeze(1) * (counts > 0).to(x.dtype)
    return x if all_rows else logits.index_copy(0, md.penalty_rows, x)


# ---- random sampling ----

def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row's (unnormalized, non-negative) probabilities with uniforms u."""
    c = probs.cumsum(dim=1)
    t = (u * c[:, -1]).unsqueeze(1)
    return torch.searchsorted(c, t, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _sample_untruncated(x: torch.Tensor, min_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    # unnormalized; the top token has 1. amax: max(dim)'s values without the argmax it also computes
    # (much faster on CPU).
    probs = (x - x.amax(dim=1, keepdim=True)).exp_()
    if min_p is not None:
        probs = probs.masked_fill(probs < min_p.unsqueeze(1), 0.0)
    return _inverse_cdf(probs, u)


def _sample_truncated(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None,
                      u: torch.Tensor, width: int, all_have_k: bool, retry: bool) -> torch.Tensor:
    """Rows with top-k and/or top-p, sampled in probability order among their `width` best tokens
    (top_k 0: no top-k). With `retry`, rows whose nucleus could reach past those tokens are sampled
    again 16x wider, until the whole vocabulary; without it the caller picks a width that suffices."""
    dev, vocab = x.device, x.shape[1]
    # A full-width sort where no retry can narrow it; the candidate path keeps topk (its tie order).
    vals, idx = x.sort(dim=1, descending=True) if width == vocab and not retry else x.topk(width, dim=1)
    has_k = top_k > 0
    keep = torch.where(has_k, top_k, width).unsqueeze(1)
    vals = vals.masked_fill(torch.arange(width, device=dev).unsqueeze(0) >= keep, float("-inf"))
    # Normalizer: over the kept top-k, or over the whole vocabulary for rows with top-p only.
    lse = vals.logsumexp(dim=1)
    if not all_have_k:
        lse = torch.where(has_k, lse, x.logsumexp(dim=1))
    probs = (vals - lse.unsqueeze(1)).exp()
    p = top_p.unsqueeze(1)
    spill = (~has_k) & (probs.sum(dim=1) <= top_p) if retry and not all_have_k and width < vocab else None
    probs = probs.masked_fill(probs.cumsum(dim=1) - probs > p, 0.0)
    if min_p is not None:
        probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs[:, :1], 0.0)
    tokens = idx.gather(1, _inverse_cdf(probs, u).unsqueeze(1)).squeeze(1)
    if spill is not None and bool(spill.any()):  # the next token past the candidates is kept too
        sp = spill.nonzero().squeeze(1)
        tokens[sp] = _sample_truncated(x[sp], top_k[sp], top_p[sp], _select(min_p, sp), u[sp],
                                       min(vocab, 16 * width), all_have_k=False, retry=True)
    return tokens


def _truncation_width(md: SamplingMetadata) -> int:
    if md.candidate_search:
        return min(md.vocab_size, max(TOP_CANDIDATES, md.max_top_k))
    return md.vocab_size if md.any_top_p_only else md.max_top_k


def _sample_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Tokens for the random rows, in random_rows order."""
    x = logits if not md.any_greedy else logits.index_select(0, md.random_rows)
    x = x / md.temperature.unsqueeze(1)
    u = _random_uniforms(md, logits.device)
    min_p = md.min_p if md.any_min_p else None
    num_trunc = md.truncated.shape[0]
    if num_trunc == 0:
        return _sample_untruncated(x, min_p, u)
    width, all_have_k = _truncation_width(md), not md.any_top_p_only
    if num_trunc == md.num_random:
        return _sample_truncated(x, md.top_k, md.top_p, min_p, u, width, all_have_k, md.candidate_search)
    tokens = torch.empty(md.num_random, dtype=torch.long, device=logits.device)
    for sel, truncated in ((md.truncated, True), (md.untruncated, False)):
        xs, us, mp = x.index_select(0, sel), u.index_select(0, sel), _select(min_p, sel)
        if truncated:
            part = _sample_truncated(xs, md.top_k.index_select(0, sel), md.top_p.index_select(0, sel), mp, us,
                                     width, all_have_k, md.candidate_search)
        else:
            part = _sample_untruncated(xs, mp, us)
        tokens.index_copy_(0, sel, part)
    return tokens


def _select(t: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, idx)


# ---- the step ----

def sample(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """logits [num_rows, vocab] float32 -> sampled ids and logprob tensors, on the device. Nothing is
    read back to the host unless md.candidate_search. The logits are modified in place only by masks
    (allowed_token_ids' and min_tokens' -inf), which a second call would set again: sampling the same
    logits twice (a row alone, after its batch failed) gives the same ids for greedy and seeded rows."""
    if md.allowed_mask is not None:
        _apply_allowed(logits, md)
    if md.any_min_tokens:
        _apply_min_tokens(logits, md)
    raw_logprobs = None
    if md.max_num_logprobs is not None:
        raw_logprobs = logits.index_select(0, md.logprob_rows).log_softmax(dim=1)
    if md.any_logit_bias:
        logits = _biased(logits, md)
    if md.any_penalties:
        logits = _penalized(logits, md)
    if md.all_greedy:
        tokens = greedy_ids(logits)
    elif not md.any_greedy:
        tokens = _sample_random(logits, md)
    else:
        tokens = greedy_ids(logits).index_copy_(0, md.random_rows, _sample_random(logits, md))
    out = SamplerOutput(tokens)
    if raw_logprobs is not None:
        _fill_logprobs(out, raw_logprobs, md)
    return out


def sampling_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution `sample` draws each row from, as float32 probabilities [num_rows, vocab]: the same
    masks, bias, penalties, temperature, top-k, top-p and min-p (greedy rows: one-hot on their argmax).
    Speculative decoding's general rejection rule compares it with a draft's distribution."""
    if md.allowed_mask is not None:
        _apply_allowed(logits, md)
    if md.any_min_tokens:
        _apply_min_tokens(logits, md)
    if md.any_logit_bias:
        logits = _biased(logits, md)
    if md.any_penalties:
        logits = _penalized(logits, md)
    probs = torch.zeros_like(logits).scatter_(1, greedy_ids(logits).unsqueeze(1), 1.0)
    if md.all_greedy:
        return probs
    x = logits.index_select(0, md.random_rows) / md.temperature.unsqueeze(1)
    vals, idx = x.sort(dim=1, descending=True)
    has_k = md.top_k > 0
    ranks = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    vals = vals.masked_fill(has_k.unsqueeze(1) & (ranks >= md.top_k.unsqueeze(1)), float("-inf"))
    p = vals.softmax(dim=1)  # over the kept top-k: top-p's nucleus is of that distribution, as in sampling
    p = p.masked_fill((md.top_p < 1.0).unsqueeze(1) & (p.cumsum(dim=1) - p > md.top_p.unsqueeze(1)), 0.0)
    if md.any_min_p:
        p = p.masked_fill(p < md.min_p.unsqueeze(1) * p[:, :1], 0.0)
    p = p / p.sum(dim=1, keepdim=True)
    return probs.index_copy_(0, md.random_rows, torch.zeros_like(p).scatter_(1, idx, p))


def _fill_logprobs(out: SamplerOutput, raw: torch.Tensor, md: SamplingMetadata) -> None:
    lp = raw.nan_to_num(nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)
    chosen = lp.gather(1, out.sampled_token_ids.index_select(0, md.logprob_rows).unsqueeze(1))
    out.sampled_logprobs = chosen.squeeze(1)
    out.sampled_ranks = (lp > chosen).sum(dim=1) + 1
    if md.max_num_logprobs > 0:
        out.top_logprobs, out.top_token_ids = lp.topk(md.max_num_logprobs, dim=1)


def logprobs_to_host(out: SamplerOutput, md: SamplingMetadata, sampled: list[int]) -> dict[int, TokenLogprobs]:
    """{batch row: TokenLogprobs} from the logprob tensors; sampled: the step's ids, already on the host."""
    if out.sampled_logprobs is None:
        return {}
    chosen, ranks = out.sampled_logprobs.tolist(), out.sampled_ranks.tolist()
    top_v = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    top_i = out.top_token_ids.tolist() if out.top_token_ids is not None else None
    result = {}
    for j, (row, n) in enumerate(zip(md.logprob_row_ids, md.num_logprobs, strict=True)):
        ids, values = [sampled[row]], [chosen[j]]
        if n:
            ids += top_i[j][:n]
            values += top_v[j][:n]
        result[row] = TokenLogprobs(token_ids=ids, logprobs=values, sampled_rank=ranks[j])
    return result


def sample_rows(logits: torch.Tensor, rows: list[RowSampling]) -> tuple[torch.Tensor, dict[int, TokenLogprobs]]:
    """The per-row entry point: metadata, sample, and the host conversion of the logprobs.
    logits [len(rows), vocab] float32 (modified in place) -> (token ids [len(rows)], {row: logprobs})."""
    md = SamplingMetadata.from_rows(rows, logits.shape[1], logits.device)
    out = sample(logits, md)
    lps = logprobs_to_host(out, md, out.sampled_token_ids.tolist()) if md.max_num_logprobs is not None else {}
    return out.sampled_token_ids, lps
