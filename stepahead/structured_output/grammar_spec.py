"""A request's constraint as the compiler sees it (a hashable GrammarSpec), and the check made when
the request arrives, so a bad schema, regex, grammar or structural tag is a ValueError (a 400 on the
server) with the compiler's own message before anything is queued.

The check parses the spec (milliseconds for specs within grammar_bounds' limits); it is remembered
per spec, so the API server can run it on a worker thread under a time limit and the engine's own
call on the same spec is a lookup.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import cast

from stepahead.sampling_params import StructuredOutputsParams
from stepahead.structured_output.lark import is_likely_lark, lark_to_ebnf
from stepahead.structured_output.structural_tag import xgrammar_structural_tag
from stepahead.validation import InvalidInputError

# xgrammar prefixes its messages with a time and a C++ source location: "[05:37:43] /project/cpp/x.cc:94: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@dataclass(frozen=True)
class GrammarSpec:
    """kind: "json" (text is a JSON schema), "json_object" (any JSON object; text is empty), "regex",
    "grammar" (EBNF text; a choice becomes one), or "structural_tag" (its JSON text, either form, see
    structural_tag.py). Equal specs compile to the same grammar."""

    kind: str
    text: str
    any_whitespace: bool = True  # the JSON kinds: False compiles compact JSON (disable_any_whitespace)


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    # params.kind names the one field that is set (and a schema is kept as its text): the casts say so.
    kind = params.kind
    any_whitespace = not params.disable_any_whitespace
    if kind == "json":
        return GrammarSpec("json", cast(str, params.json), any_whitespace)
    if kind == "json_object":
        return GrammarSpec("json_object", "", any_whitespace)
    if kind == "structural_tag":
        return GrammarSpec("structural_tag", cast(str, params.structural_tag))
    if kind == "regex":
        return GrammarSpec("regex", cast(str, params.regex))
    if kind == "choice":
        # JSON string escapes are EBNF string escapes, so any choice text is one literal.
        literals = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in cast(list[str], params.choice))
        return GrammarSpec("grammar", f"root ::= {literals}")
    grammar = cast(str, params.grammar)
    if is_likely_lark(grammar):  # vLLM accepts Lark's syntax too: converted to EBNF
        grammar = lark_to_ebnf(grammar)
    return GrammarSpec("grammar", grammar)


def compiler_message(error: Exception) -> str:
    """The compiler's message without its log prefix, on one line."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(error).strip().splitlines()]
    return " ".join(line for line in lines if line)


_WHAT = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "structural_tag": "structural tag"}


def validate_structured_outputs(params: StructuredOutputsParams) -> GrammarSpec:
    """Parse the constraint (no vocabulary needed); InvalidInputError names what is wrong."""
    spec = grammar_spec(params)
    _parse(spec)
    return spec


@functools.lru_cache(maxsize=256)  # only successes are remembered: a raise is not cached
def _parse(spec: GrammarSpec) -> None:
    import xgrammar as xgr  # imported on the first constrained request: it takes a second

    try:
        if spec.kind == "json":
            json.loads(spec.text)
            xgr.Grammar.from_json_schema(spec.text)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.text)
        elif spec.kind == "structural_tag":
            xgr.Grammar.from_structural_tag(xgrammar_structural_tag(spec.text))
    except (RuntimeError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise InvalidInputError(f"invalid {_WHAT[spec.kind]} in structured_outputs: {compiler_message(e)}",
                                param="structured_outputs") from e
