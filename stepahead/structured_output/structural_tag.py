"""Structural tags: free text, and after a trigger a tagged part the grammar constrains.

A request gives one as JSON text in one of two forms. vLLM's legacy form lists structures and
triggers: `{"structures": [{"begin": "<fn=add>", "schema": {...}, "end": "</fn>"}], "triggers":
["<fn="]}`: the output is free until a trigger, then a structure whose begin starts with it, its JSON
matching the schema, and its end; then free again. xgrammar's own form, `{"type": "structural_tag",
"format": {...}}`, nests formats (tags, sequences, JSON schemas, regexes, grammars, ...). xgrammar
compiles the second; the first becomes the second through xgrammar's own conversion, as vLLM's
xgrammar backend does.
"""

from __future__ import annotations

import json
from typing import Any


def _is_structure(item: Any) -> bool:
    return (isinstance(item, dict) and isinstance(item.get("begin"), str) and isinstance(item.get("end"), str)
            and isinstance(item.get("schema"), dict))


def xgrammar_structural_tag(text: str) -> str:
    """The structural tag in xgrammar's form, as JSON text. ValueError says what is malformed in the
    legacy form; xgrammar's parser checks its own form when it compiles it."""
    import xgrammar as xgr

    try:
        tag = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not (isinstance(tag, dict) and "structures" in tag):
        return text
    structures, triggers = tag["structures"], tag.get("triggers")
    if not (isinstance(structures, list) and structures and all(_is_structure(s) for s in structures)):
        raise ValueError('"structures" must be a non-empty list of {"begin": string, "schema": object, '
                         '"end": string}')
    if not (isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)):
        raise ValueError('"triggers" must be a non-empty list of non-empty strings')
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=s["schema"], end=s["end"]) for s in structures]
    return xgr.StructuralTag.from_legacy_structural_tag(items, triggers).model_dump_json()
