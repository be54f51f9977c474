"""Random JSON schemas, regexes and choice lists for the structured-output tests (seeded, so reproducible)."""

from __future__ import annotations

import random

WORDS = ["red", "green", "blue", "cat", "dog", "paris", "rome", "tea", "yes", "no", "alpha", "beta"]


def _name(rng: random.Random) -> str:
    return rng.choice(["name", "age", "city", "color", "tags", "score", "id", "pet", "ok", "info", "items", "kind"])


def _value_schema(rng: random.Random, depth: int) -> dict:
    kinds = ["integer", "boolean", "enum", "pattern", "short_string", "int_array", "number"]
    if depth < 2:
        kinds += ["object", "enum_array"]
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 100}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{1,8}$", "^[A-Z][a-z]{0,6}$", "^[0-9]{3}-[0-9]{2}$"])}
    if kind == "short_string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 12)}
    if kind == "int_array":
        return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "minItems": 1, "maxItems": rng.randint(1, 4)}
    if kind == "enum_array":
        return {"type": "array", "items": {"enum": rng.sample(WORDS, 3)}, "maxItems": 3}
    return random_object_schema(rng, depth + 1)


def random_object_schema(rng: random.Random, depth: int = 0) -> dict:
    names = list(dict.fromkeys(_name(rng) for _ in range(rng.randint(1, 4))))
    properties = {name: _value_schema(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    schema = {"type": "object", "properties": properties, "required": required}
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema


def random_regex(rng: random.Random) -> str:
    return rng.choice([
        r"[a-z]{2,8}",
        r"(yes|no|maybe)",
        r"[0-9]{1,4}(\.[0-9]{1,2})?",
        r"[A-Z][a-z]{1,6} [A-Z][a-z]{1,6}",
        r"\d{3}-\d{4}",
        r"(cat|dog)s? (run|sleep)",
        r"[a-f0-9]{8}",
    ])


def random_choice(rng: random.Random) -> list[str]:
    return rng.sample(WORDS + ["New York", "a \"quoted\" word", "naïve", "42"], rng.randint(2, 5))
