"""Benchmark workloads: seeded random prompts (token ids or text) and JSONL prompt files.

Every benchmark (serve, throughput, latency) draws its requests from here so that the same seed gives
the same prompts and lengths whichever engine is measured.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stepahead.validation import check_field


@dataclass
class SampleRequest:
    """One benchmark request: the prompt (text or token ids), its length in tokens and the output budget."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int

    def engine_prompt(self) -> str | dict:
        """The prompt in the form LLM.generate takes."""
        if isinstance(self.prompt, str):
            return self.prompt
        return {"prompt_token_ids": list(self.prompt)}


def uniform_lengths(rng: np.random.Generator, num: int, low: int, high: int) -> np.ndarray:
    """num integers drawn uniformly from [low, high], both ends included."""
    return rng.integers(low, high + 1, size=num)


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's random-dataset range: [length * (1 - r), length * (1 + r)], at least 1."""
    check_field(0.0 <= range_ratio < 1.0, "random_range_ratio", range_ratio, "must be in [0, 1)")
    low = max(1, int(length * (1.0 - range_ratio)))
    high = max(low, int(length * (1.0 + range_ratio)))
    return low, high


def _token_pool(vocab_size: int, exclude: Sequence[int]) -> np.ndarray:
    """Token ids a random prompt may use: the vocabulary minus special tokens."""
    check_field(vocab_size >= 2, "vocab_size", vocab_size, "must be >= 2")
    pool = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.asarray(list(exclude), dtype=np.int64))
    check_field(pool.size > 0, "vocab_size", vocab_size, "leaves no token once special tokens are excluded")
    return pool


def random_token_requests(
    num: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    exclude_ids: Sequence[int] = (),
) -> list[SampleRequest]:
    """num prompts of random token ids; input and output lengths uniform in the given [min, max] ranges.

    This is nano-vllm's bench.py protocol (there: 256 prompts, both ranges [100, 1024]).
    """
    check_field(num >= 1, "num_prompts", num, "must be >= 1")
    (in_lo, in_hi), (out_lo, out_hi) = input_len, output_len
    check_field(1 <= in_lo <= in_hi, "input_len", input_len, "must be a range 1 <= min <= max")
    check_field(1 <= out_lo <= out_hi, "output_len", output_len, "must be a range 1 <= min <= max")
    rng = np.random.default_rng(seed)
    pool = _token_pool(vocab_size, exclude_ids)
    in_lens = uniform_lengths(rng, num, in_lo, in_hi)
    out_lens = uniform_lengths(rng, num, out_lo, out_hi)
    requests = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist(), strict=True):
        ids = pool[rng.integers(0, pool.size, size=n_in)].tolist()
        requests.append(SampleRequest(prompt=ids, prompt_len=n_in, expected_output_len=n_out))
    return requests


def random_text_requests(
    tokenizer,
    num: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
) -> list[SampleRequest]:
    """Random prompts as text: random ids decoded, re-encoded and trimmed until the text is the target length.

    Decoding then re-encoding random ids rarely round-trips (merges change), so the text is trimmed
    or extended by whole tokens until its own encoding has the drawn length, as vLLM's random dataset does.
    """
    vocab_size = len(tokenizer)
    special = list(getattr(tokenizer, "all_special_ids", []) or [])
    token_reqs = random_token_requests(num, input_len, output_len, vocab_size, seed, special)
    rng = np.random.default_rng(seed + 1)
    pool = _token_pool(vocab_size, special)
    requests = []
    for req in token_reqs:
        ids = list(req.prompt)
        target = req.prompt_len
        for _ in range(8):  # a few rounds converge for byte-level BPE; stop either way
            text = tokenizer.decode(ids)
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == target:
                break
            if len(encoded) > target:
                ids = encoded[:target]
            else:
                ids = encoded + pool[rng.integers(0, pool.size, size=target - len(encoded))].tolist()
        text = tokenizer.decode(ids)
        prompt_len = len(tokenizer.encode(text, add_special_tokens=False))
        requests.append(SampleRequest(prompt=text, prompt_len=prompt_len, expected_output_len=req.expected_output_len))
    return requests


def load_jsonl_requests(
    path: str | Path,
    num: int | None,
    default_output_len: int,
    tokenizer=None,
) -> list[SampleRequest]:
    """Prompts from a JSONL file, one object a line.

    Each line has "prompt" (text) or "prompt_token_ids" (list of ints); "output_len" or "max_tokens",
    when present, overrides default_output_len. Text prompt lengths are counted with the tokenizer when
    one is given (else 0: the server's usage report gives the real count).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset_path must be an existing JSONL file, got {str(path)!r}")
    requests: list[SampleRequest] = []
    with path.open() as lines:
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"dataset_path line {lineno} is not JSON: {e}") from e
            out_len = int(row.get("output_len", row.get("max_tokens", default_output_len)))
            check_field(out_len >= 1, f"dataset_path line {lineno} output_len", out_len, "must be >= 1")
            if "prompt_token_ids" in row:
                ids = [int(token_id) for token_id in row["prompt_token_ids"]]
                requests.append(SampleRequest(prompt=ids, prompt_len=len(ids), expected_output_len=out_len))
            elif isinstance(row.get("prompt"), str):
                text = row["prompt"]
                prompt_len = len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else 0
                requests.append(SampleRequest(prompt=text, prompt_len=prompt_len, expected_output_len=out_len))
            else:
                raise ValueError(f"dataset_path line {lineno} needs a 'prompt' string or 'prompt_token_ids' list")
            if num is not None and len(requests) >= num:
                break
    check_field(len(requests) > 0, "dataset_path", str(path), "holds no prompt")
    if num is not None and len(requests) < num:
        # Cycle the file so --num-prompts means the same thing for every dataset.
        requests = [requests[index % len(requests)] for index in range(num)]
    return requests
