"""Benchmark workloads: seeded, in range, and the same prompts for every engine."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from stepahead.bench.datasets import (
    SampleRequest,
    length_bounds,
    load_jsonl_requests,
    random_text_requests,
    random_token_requests,
)


def test_random_tokens_are_seeded_and_in_range():
    a = random_token_requests(200, (100, 1024), (5, 9), vocab_size=500, seed=3, exclude_ids=[0, 1, 2])
    b = random_token_requests(200, (100, 1024), (5, 9), vocab_size=500, seed=3, exclude_ids=[0, 1, 2])
    c = random_token_requests(200, (100, 1024), (5, 9), vocab_size=500, seed=4, exclude_ids=[0, 1, 2])
    assert a == b and a != c
    assert all(100 <= r.prompt_len == len(r.prompt) <= 1024 for r in a)
    assert {r.expected_output_len for r in a} == {5, 6, 7, 8, 9}  # both ends reachable
    ids = {t for r in a for t in r.prompt}
    assert min(ids) >= 3 and max(ids) < 500
    assert a[0].engine_prompt() == {"prompt_token_ids": a[0].prompt}


def test_length_bounds_follow_vllm_range_ratio():
    assert length_bounds(100, 0.0) == (100, 100)
    assert length_bounds(100, 0.5) == (50, 150)
    assert length_bounds(1, 0.9) == (1, 1)
    with pytest.raises(ValueError, match="random_range_ratio"):
        length_bounds(10, 1.0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(num=0), "num_prompts"),
    (dict(input_len=(5, 2)), "input_len"),
    (dict(output_len=(0, 3)), "output_len"),
    (dict(vocab_size=3, exclude_ids=[0, 1, 2]), "vocab_size"),
])
def test_random_tokens_reject_bad_input(kwargs, field):
    args = dict(num=2, input_len=(1, 4), output_len=(1, 4), vocab_size=50, seed=0, exclude_ids=())
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        random_token_requests(**args)


def test_random_text_hits_the_target_length(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    reqs = random_text_requests(tok, 20, (16, 64), (4, 4), seed=0)
    assert all(isinstance(r.prompt, str) for r in reqs)
    exact = sum(len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len for r in reqs)
    assert exact == 20  # prompt_len is the text's own encoded length
    assert sum(16 <= r.prompt_len <= 64 for r in reqs) >= 18  # and nearly always the drawn one


def test_jsonl_prompts_cycle_and_validate(tmp_path, tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "def main():"}) + "\n\n" + json.dumps({"prompt_token_ids": [7, 8, 9],
                                                                               "output_len": 5}) + "\n")
    reqs = load_jsonl_requests(f, 5, default_output_len=11, tokenizer=tok)
    assert len(reqs) == 5 and reqs[2] == reqs[0]
    assert reqs[0].expected_output_len == 11 and reqs[0].prompt_len == len(tok.encode("def main():"))
    assert reqs[1] == SampleRequest([7, 8, 9], 3, 5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_jsonl_requests(bad, None, 4)
    with pytest.raises(ValueError, match="dataset_path"):
        load_jsonl_requests(tmp_path / "missing.jsonl", None, 4)
