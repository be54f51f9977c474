"""Bounds on a request's grammar constraint, checked before anything parses or compiles it.

A JSON schema (or a structural tag, which holds schemas) is a tree whose depth the client chooses.
Code that walks it recursively (a pickler, a JSON encoder, the grammar compiler) fails or takes
superlinear time on a deep one, so the depth is measured here without recursion and refused past
MAX_JSON_NESTING; a spec longer than MAX_SPEC_CHARS is refused before it is read at all. The schema
then travels as its text: the engine's messages never carry a structure whose depth a request controls.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from stepahead.validation import InvalidInputError

# Objects and arrays inside one another. A schema level with "properties" costs two; real schemas stay
# far below this, and the compile time of a schema grows quickly with its depth.
MAX_JSON_NESTING = 128
# Characters of a schema, regex, grammar, structural tag or the choices together.
MAX_SPEC_CHARS = 128 * 1024

PARAM = "structured_outputs"


def json_value_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (0 for a scalar), by an explicit stack. Stops counting
    once past MAX_JSON_NESTING, so a hostile value costs at most a walk to that depth per branch."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Iterable[Any] = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_JSON_NESTING:
            return depth
        stack.extend((child, depth + 1) for child in children)
    return deepest


def json_text_depth(text: str) -> int:
    """Nesting depth of JSON text, by counting brackets outside strings (no parse needed)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def check_spec_chars(num_chars: int, what: str) -> None:
    if num_chars > MAX_SPEC_CHARS:
        raise InvalidInputError(
            f"structured_outputs: the {what} has {num_chars} characters, more than the limit of {MAX_SPEC_CHARS}",
            param=PARAM)


def _check_depth(depth: int, what: str) -> None:
    if depth > MAX_JSON_NESTING:
        raise InvalidInputError(
            f"structured_outputs: the {what} nests objects and arrays more than {MAX_JSON_NESTING} deep "
            f"(the limit of nesting depth)", param=PARAM)


def bounded_json_text(value: Any, what: str) -> str:
    """A JSON value (parsed or text: a schema, or a structural tag holding schemas) as bounded text:
    depth and size checked, nothing recursive run on it before the depth is known to be small. `what`
    names it in a refusal."""
    if isinstance(value, str):
        check_spec_chars(len(value), what)
        _check_depth(json_text_depth(value), what)
        return value
    _check_depth(json_value_depth(value), what)
    text = json.dumps(value, ensure_ascii=False)
    check_spec_chars(len(text), what)
    return text
