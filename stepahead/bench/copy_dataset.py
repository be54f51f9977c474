"""A copy-heavy workload: prompts whose answers copy most of their text from the prompt.

Three kinds, built locally from a seed (no download): edit a function (rename a variable), repeat a
record list with one change, and extract fields from records. Such answers are where n-gram drafts
(speculative decoding's "ngram" method) hit; `stepahead bench throughput --dataset copy` measures them.
Each prompt shows the source, then the instruction, then starts the answer, so a plain completion
model continues by copying.
"""

from __future__ import annotations

import numpy as np

from stepahead.bench.datasets import SampleRequest

_NAMES = ["total", "count", "index", "value", "result", "items", "buffer", "offset", "limit", "score", "weight",
          "length", "cursor", "record", "amount", "factor"]
_PEOPLE = ["Alice Moreau", "Bruno Tanaka", "Chloe Okafor", "Dmitri Weiss", "Elena Rossi", "Farid Haddad",
           "Grace Lindqvist", "Hiro Sato", "Ines Duarte", "Jonas Berg", "Kira Novak", "Liam O'Brien"]
_CITIES = ["Lisbon", "Osaka", "Lagos", "Vienna", "Turin", "Beirut", "Uppsala", "Kyoto", "Porto", "Bergen"]


def _function(rng: np.random.Generator) -> tuple[str, str, str]:
    a, b, c, d = (str(x) for x in rng.choice(_NAMES, size=4, replace=False))
    lines = [f"def update_{a}({a}, {b}, {c}=0):",
             f'    """Fold every {b} into {a}, starting from {c}."""',
             f"    {d} = {c}",
             f"    for step, item in enumerate({b}):",
             "        if item is None:",
             "            continue",
             f"        {d} += item * (step + 1)",
             f"        {a}[step % len({a})] = {d}",
             f"    if {d} > {int(rng.integers(10, 999))}:",
             f"        {a}.append({d})",
             f"    return {a}, {d}"]
    code = "\n".join(lines)
    new = str(rng.choice([n for n in _NAMES if n not in (a, b, c, d)]))
    return code, f"the same function with the variable `{d}` renamed to `{new}`", lines[0]


def _records(rng: np.random.Generator, num: int) -> list[tuple[str, int, str]]:
    people = rng.choice(_PEOPLE, size=num, replace=False)
    return [(str(p), int(rng.integers(20, 70)), str(rng.choice(_CITIES))) for p in people]


def _record_list(rng: np.random.Generator) -> tuple[str, str, str]:
    rows = _records(rng, 8)
    text = "\n".join(f"- name: {n}; age: {a}; city: {c}; email: {n.split()[0].lower()}@example.org"
                     for n, a, c in rows)
    moved = rows[int(rng.integers(0, len(rows)))][0]
    return text, f"the same list, with {moved} living in {rng.choice(_CITIES)}", text.splitlines()[0]


def _extraction(rng: np.random.Generator) -> tuple[str, str, str]:
    rows = _records(rng, 6)
    text = "\n".join(f"{n} ({a}) moved to {c} last year and can be reached at {n.split()[0].lower()}@example.org."
                     for n, a, c in rows)
    first = rows[0]
    start = f'{{"name": "{first[0]}", "age": {first[1]}, "city": "{first[2]}"'
    return text, "one JSON object per person with the fields name, age, city and email", start


_KINDS = (_function, _record_list, _extraction)


def copy_heavy_requests(tokenizer, num: int, output_len: int, seed: int = 0) -> list[SampleRequest]:
    """num prompts cycling through the three kinds, each with output budget output_len."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(num):
        source, instruction, answer_start = _KINDS[i % len(_KINDS)](rng)
        prompt = f"Source:\n{source}\n\nBelow is {instruction}.\n\n{answer_start}\n"
        ids = tokenizer.encode(prompt, add_special_tokens=False)  # token ids, as every engine takes them
        requests.append(SampleRequest(prompt=ids, prompt_len=len(ids), expected_output_len=output_len))
    return requests
