"""A parameter value the model wrote as bare text (Qwen3-Coder's `<parameter=P>VALUE</parameter>`), made the
JSON value its parameter's schema types it as (vLLM's rules): text for a string or an unknown parameter;
a number, boolean or null parsed, and the text itself when it does not parse; objects and arrays read as
JSON, else as a Python literal (templates render values with Python's str(), so True and None come back
that way)."""

from __future__ import annotations

import ast
import json
import math
from typing import Any

_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_NULLS = ("null", "none")


def typed_value(text: str, schema: dict[str, Any] | None) -> Any:
    """The value of `text` for a parameter with this JSON schema (None: a parameter the function does not
    declare, whose value stays text)."""
    if schema is None:
        return text
    kind, nullable = _kind(schema)
    if nullable and text.lower() in _NULLS:
        return None
    if kind in _STRING_TYPES:
        return text
    if text.lower() in _NULLS:
        return None
    if kind.startswith(_INTEGER_PREFIXES):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text  # JSON has no infinity or NaN
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    return _structured(text, kind in ("object", "array", "arr") or kind.startswith(("dict", "list")))


def _kind(schema: dict[str, Any]) -> tuple[str, bool]:
    """The schema's first type that is not null ("string" when it names none), and whether null is allowed."""
    types: list[str] = []
    declared = schema.get("type")
    if isinstance(declared, str):
        types = [declared]
    elif isinstance(declared, list):
        types = [t for t in declared if isinstance(t, str)]
    else:
        for option in schema.get("anyOf") or schema.get("oneOf") or ():
            if isinstance(option, dict) and isinstance(option.get("type"), str):
                types.append(option["type"])
    types = [t.strip().lower() for t in types]
    nullable = "null" in types
    return next((t for t in types if t != "null"), "string"), nullable


def _structured(text: str, container: bool) -> Any:
    """JSON first for objects and arrays, then a Python literal; the text itself when neither reads or the
    value has no JSON form (a set, bytes, an infinity)."""
    for reader in ((json.loads, ast.literal_eval) if container else (ast.literal_eval,)):
        try:
            return json.loads(json.dumps(reader(text), allow_nan=False))  # tuples become lists
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
    return text
