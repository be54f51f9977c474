"""Per-step sampling inputs as device tensors, built once on the host and sent in one copy.

`SamplingMetadata.from_rows` turns the runner's per-row `RowSampling` list into numpy arrays, packs
them into one int64 buffer (pinned on CUDA) and copies it to the device with a single non-blocking
transfer; the tensors are views into that buffer. Everything the sampler branches on (all greedy?
any penalties? which rows are truncated? how many logprobs?) is decided here from the parameters, so
the device code never has to read a tensor back to choose a path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stepahead.sampling_params import SamplingParams


@dataclass
class RowSampling:
    """What the sampler needs to know about one row that samples this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # may be empty when the row uses no penalties (only its count matters then)
    stop_token_ids: list[int]  # suppressed while fewer than min_tokens outputs exist (eos + stop_token_ids)
    num_output_tokens: int = -1  # -1: len(output_token_ids)

    def __post_init__(self) -> None:
        if self.num_output_tokens < 0:
            self.num_output_tokens = len(self.output_token_ids)


def banned_bad_word_tokens(bad_words: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end the output (a one-token word, always)."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or (len(output_token_ids) >= len(prefix) and output_token_ids[-len(prefix):] == prefix):
            banned.append(word[-1])
    return banned


def seed_as_int64(seed: int) -> int:
    """A request seed reduced modulo 2**64 and stored as a two's-complement int64."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


class _HostPack:
    """Named host arrays laid out in one int64 buffer (each at an 8-byte boundary), so that the step's
    metadata reaches the device in one copy and every array is a typed view of the device buffer."""

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}  # name -> (array, byte offset)
        self._nbytes = 0

    def add(self, name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        self._arrays[name] = (array, self._nbytes)
        self._nbytes += -(-array.nbytes // 8) * 8

    def upload(self, device: torch.device) -> dict[str, torch.Tensor]:
        if device.type == "cpu":  # nothing to copy: the tensors can share the arrays' memory
            return {name: torch.from_numpy(array) for name, (array, _) in self._arrays.items()}
        host = torch.empty(max(1, self._nbytes // 8), dtype=torch.int64, pin_memory=device.type == "cuda")
        host_bytes = host.numpy().view(np.uint8)
        for array, off in self._arrays.values():
            host_bytes[off:off + array.nbytes] = array.reshape(-1).view(np.uint8)
        dev_bytes = (host if device.type == "cpu" else host.to(device, non_blocking=True)).view(torch.uint8)
        return {name: dev_bytes[off:off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
                for name, (a, off) in self._arrays.items()}


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32,
                 np.dtype(np.bool_): torch.bool}


@dataclass(frozen=True)
class SamplingMetadata:
    """One step's sampling inputs. Tensors live on the sampling device; the rest is host-known.

    Random rows are the rows that do not sample greedily (temperature > 0 and top_k != 1); their
    parameters are stored in `random_rows` order. Of them, the truncated rows (top-k below the
    vocabulary or top-p below 1) sample in probability order among their best tokens, the others in
    vocabulary order over the whole distribution.
    """

    num_rows: int
    vocab_size: int
    # -- random rows --
    random_rows: torch.Tensor  # [R] int64: batch row of each random row
    temperature: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int64; 0: no top-k (also when top_k >= vocab_size)
    top_p: torch.Tensor  # [R] float32
    min_p: torch.Tensor  # [R] float32
    seeded: torch.Tensor  # [R] bool
    seeds: torch.Tensor  # [R] int64: seed_as_int64(params.seed), 0 when unseeded
    output_index: torch.Tensor  # [R] int64: output tokens the row already has (the seeded draw's counter)
    truncated: torch.Tensor  # [T] int64: positions in random_rows of the truncated rows
    untruncated: torch.Tensor  # [R - T] int64: positions of the others
    # -- min_tokens' stop tokens and banned bad-word tokens: (row, token) pairs to set to -inf --
    stop_rows: torch.Tensor  # [S] int64
    stop_tokens: torch.Tensor  # [S] int64
    # -- penalties, for the rows that use one (None when no row does) --
    penalty_rows: torch.Tensor | None  # [P] int64
    repetition_penalty: torch.Tensor | None  # [P] float32
    frequency_penalty: torch.Tensor | None  # [P] float32
    presence_penalty: torch.Tensor | None  # [P] float32
    output_counts: torch.Tensor | None  # [P, vocab] float32: occurrences of each token in the output
    prompt_mask: torch.Tensor | None  # [P, vocab] bool: token occurs in the prompt; None without repetition
    # -- allowed_token_ids: the rows that restrict their tokens (None when no row does) --
    allowed_rows: torch.Tensor | None  # [A] int64
    allowed_mask: torch.Tensor | None  # [A, vocab] bool: the token may be sampled
    # -- logit_bias: (row, token, bias) triples, added before penalties --
    bias_rows: torch.Tensor  # [B] int64
    bias_tokens: torch.Tensor  # [B] int64
    bias_values: torch.Tensor  # [B] float32
    # -- logprobs --
    logprob_rows: torch.Tensor  # [L] int64: batch rows that want logprobs
    logprob_row_ids: tuple[int, ...]  # the same rows, on the host
    num_logprobs: tuple[int, ...]  # top-N wanted by each of them
    # -- host-known decisions --
    all_greedy: bool
    any_seeded: bool
    any_unseeded: bool  # some random row draws from the global RNG
    any_min_p: bool
    max_top_k: int  # the largest top-k among the truncated rows (0: none has one)
    any_top_p_only: bool  # a truncated row has top-p but no top-k: its nucleus has no fixed width
    max_num_logprobs: int | None  # None: no row wants logprobs
    # True: truncated rows sample among sampler.TOP_CANDIDATES and retry wider when the nucleus spills (exact,
    # fast on CPU, reads a flag back). False: sort as wide as needed, no read-back (the CUDA path).
    candidate_search: bool

    @property
    def num_random(self) -> int:
        return self.random_rows.shape[0]

    @property
    def any_greedy(self) -> bool:
        return self.num_random < self.num_rows

    @property
    def any_penalties(self) -> bool:
        return self.penalty_rows is not None

    @property
    def any_min_tokens(self) -> bool:
        return self.stop_rows.shape[0] > 0

    @property
    def any_logit_bias(self) -> bool:
        return self.bias_rows.shape[0] > 0

    @staticmethod
    def from_rows(rows: list[RowSampling], vocab_size: int, device: torch.device | str,
                  candidate_search: bool | None = None) -> SamplingMetadata:
        """Host arrays from the rows' parameters, one copy to `device`, and the penalty tables built
        there. candidate_search defaults to True on CPU and False elsewhere."""
        device = torch.device(device)
        params = [r.params for r in rows]
        rand = [i for i, p in enumerate(params) if not (p.is_greedy or p.top_k == 1)]
        rp = [params[i] for i in rand]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in rp]
        trunc = [j for j, p in enumerate(rp) if top_k[j] > 0 or p.top_p < 1.0]
        trunc_set = set(trunc)
        suppress = [(i, t) for i, r in enumerate(rows)
                    if r.num_output_tokens < r.params.min_tokens for t in r.stop_token_ids]
        suppress += [(i, t) for i, r in enumerate(rows) if r.params.bad_words_token_ids
                     for t in banned_bad_word_tokens(r.params.bad_words_token_ids, r.output_token_ids)]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        # lp_rows' counts; -1 is the whole vocabulary
        num_logprobs = tuple(vocab_size if n == -1 else n for p in params if (n := p.logprobs) is not None)
        pen = [i for i, p in enumerate(params) if p.uses_penalties]
        rep = [i for i in pen if params[i].repetition_penalty != 1.0]
        allowed = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        # Ids past the logits' width are dropped (the frontend refuses ids outside the vocabulary).
        bias = [(i, t, b) for i, p in enumerate(params) if p.logit_bias
                for t, b in p.logit_bias.items() if t < vocab_size]

        pack = _HostPack()
        f32, i64 = np.float32, np.int64
        for name, values, dtype in (
                ("random_rows", rand, i64),
                ("temperature", [p.temperature for p in rp], f32),
                ("top_k", top_k, i64),
                ("top_p", [p.top_p for p in rp], f32),
                ("min_p", [p.min_p for p in rp], f32),
                ("seeded", [p.seed is not None for p in rp], np.bool_),
                ("seeds", [seed_as_int64(p.seed or 0) for p in rp], i64),
                ("output_index", [rows[i].num_output_tokens for i in rand], i64),
                ("truncated", trunc, i64),
                ("untruncated", [j for j in range(len(rand)) if j not in trunc_set], i64),
                ("stop_rows", [i for i, _ in suppress], i64),
                ("stop_tokens", [t for _, t in suppress], i64),
                ("logprob_rows", lp_rows, i64),
                ("bias_rows", [i for i, _, _ in bias], i64),
                ("bias_tokens", [t for _, t, _ in bias], i64),
                ("bias_values", [b for _, _, b in bias], f32)):
            pack.add(name, np.array(values, dtype=dtype))
        if allowed:
            pack.add("allowed_rows", np.array(allowed, dtype=i64))
            pack.add("allowed_positions", _flat_positions([params[i].allowed_token_ids or [] for i in allowed],
                                                          vocab_size))
        if pen:
            pack.add("penalty_rows", np.array(pen, dtype=i64))
            for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
                pack.add(name, np.array([getattr(params[i], name) for i in pen], dtype=f32))
            # Flat [P * vocab] positions of every output (and, for repetition, prompt) token.
            pack.add("output_positions", _flat_positions([rows[i].output_token_ids for i in pen], vocab_size))
            if rep:
                rep_set = set(rep)
                pack.add("prompt_positions", _flat_positions(
                    [rows[i].prompt_token_ids if i in rep_set else [] for i in pen], vocab_size))
        tensors = pack.upload(device)

        counts = mask = None
        if pen:
            # Scatter-add and index-fill into fresh tables: no read-back on any device.
            counts = torch.zeros(len(pen), vocab_size, dtype=torch.float32, device=device)
            pos = tensors["output_positions"]
            counts.view(-1).scatter_add_(0, pos, torch.ones_like(pos, dtype=torch.float32))
            if rep:
                mask = torch.zeros(len(pen), vocab_size, dtype=torch.bool, device=device)
                mask.view(-1).index_fill_(0, tensors["prompt_positions"], True)
        allowed_mask = None
        if allowed:
            allowed_mask = torch.zeros(len(allowed), vocab_size, dtype=torch.bool, device=device)
            allowed_mask.view(-1).index_fill_(0, tensors["allowed_positions"], True)
        return SamplingMetadata(
            num_rows=len(rows), vocab_size=vocab_size,
            random_rows=tensors["random_rows"], temperature=tensors["temperature"], top_k=tensors["top_k"],
            top_p=tensors["top_p"], min_p=tensors["min_p"], seeded=tensors["seeded"], seeds=tensors["seeds"],
            output_index=tensors["output_index"], truncated=tensors["truncated"],
            untruncated=tensors["untruncated"],
            stop_rows=tensors["stop_rows"], stop_tokens=tensors["stop_tokens"],
            penalty_rows=tensors.get("penalty_rows"), repetition_penalty=tensors.get("repetition_penalty"),
            frequency_penalty=tensors.get("frequency_penalty"), presence_penalty=tensors.get("presence_penalty"),
            output_counts=counts, prompt_mask=mask,
            allowed_rows=tensors.get("allowed_rows"), allowed_mask=allowed_mask,
            bias_rows=tensors["bias_rows"], bias_tokens=tensors["bias_tokens"], bias_values=tensors["bias_values"],
            logprob_rows=tensors["logprob_rows"], logprob_row_ids=tuple(lp_rows),
            num_logprobs=num_logprobs,
            all_greedy=not rand,
            any_seeded=any(p.seed is not None for p in rp),
            any_unseeded=any(p.seed is None for p in rp),
            any_min_p=any(p.min_p > 0 for p in rp),
            max_top_k=max((top_k[j] for j in trunc), default=0),
            any_top_p_only=any(top_k[j] == 0 for j in trunc),
            max_num_logprobs=max(num_logprobs, default=None),
            candidate_search=device.type == "cpu" if candidate_search is None else candidate_search,
        )


def _flat_positions(token_lists: list[list[int]], vocab_size: int) -> np.ndarray:
    """int64 positions list_index * vocab_size + token of every token inside the vocabulary (others dropped)."""
    lens = [len(t) for t in token_lists]
    toks = np.fromiter((t for ts in token_lists for t in ts), dtype=np.int64, count=sum(lens))
    owner = np.repeat(np.arange(len(token_lists), dtype=np.int64), lens)
    keep = (toks >= 0) & (toks < vocab_size)
    return owner[keep] * vocab_size + toks[keep]
