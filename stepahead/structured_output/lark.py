"""Grammars in Lark's syntax, converted to the EBNF xgrammar compiles (vLLM converts them too).

A grammar with no `::=` whose definitions read `name: ...` is taken for Lark. The conversion covers
the part of Lark that is a context-free grammar over characters: rules and terminals (`?`/`!` and
priorities dropped), alternatives continued on `|` lines, `"..."` and `'...'` literals, `"a".."z"`
ranges, `[x]` (optional), `x~n` and `x~n..m`, `-> alias` (dropped), `//` comments, and `%import
common.NAME` for the common terminals below. `start` becomes `root`. What has no EBNF equivalent is an
InvalidInputError naming it: regular expressions `/.../`, `%ignore`, `%declare`, templates, other imports.
"""

from __future__ import annotations

import json
import re

from stepahead.validation import InvalidInputError

_DEFINITION = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z0-9_]*)(\.-?\d+)?\s*:(?!:)")
# Lark's common terminals, as EBNF (the ones grammars import most).
_COMMON = {
    "DIGIT": "[0-9]", "HEXDIGIT": "[0-9a-fA-F]", "LETTER": "[a-zA-Z]", "LCASE_LETTER": "[a-z]",
    "UCASE_LETTER": "[A-Z]", "INT": "[0-9]+", "SIGNED_INT": "[+-]? [0-9]+",
    "DECIMAL": "[0-9]+ \".\" [0-9]* | \".\" [0-9]+",
    "NUMBER": "[0-9]+ (\".\" [0-9]*)? ([eE] [+-]? [0-9]+)?",
    "SIGNED_NUMBER": "[+-]? [0-9]+ (\".\" [0-9]*)? ([eE] [+-]? [0-9]+)?",
    "FLOAT": "[0-9]+ \".\" [0-9]* ([eE] [+-]? [0-9]+)?",
    "ESCAPED_STRING": "\"\\\"\" ([^\"\\\\] | \"\\\\\" [^\\n])* \"\\\"\"",
    "WORD": "[a-zA-Z]+", "CNAME": "[a-zA-Z_] [a-zA-Z0-9_]*", "WS": "[ \\t\\f\\r\\n]+",
    "WS_INLINE": "[ \\t]+", "NEWLINE": "(\"\\r\"? \"\\n\")+", "CR": "\"\\r\"", "LF": "\"\\n\"",
}
_TOKEN = re.compile(r"""
    (?P<string>"(?:[^"\\\n]|\\.)*"i?|'(?:[^'\\\n]|\\.)*'i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<range>\.\.)
  | (?P<repeat>~\s*\d+(?:\s*\.\.\s*\d+)?)
  | (?P<alias>->\s*[A-Za-z_][A-Za-z0-9_]*)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<space>\s+)
  | (?P<op>[()\[\]|*+?])
""", re.VERBOSE)


def is_likely_lark(grammar: str) -> bool:
    """No EBNF definition (`::=`), and some line defines `name: ...`."""
    if "::=" in grammar:
        return False
    return any(_DEFINITION.match(line) for line in _strip_comments(grammar).splitlines())


def _refuse(what: str) -> InvalidInputError:
    return InvalidInputError(f"structured_outputs: the Lark grammar uses {what}, which has no EBNF equivalent here "
                             "(write the grammar in EBNF with ::=)", param="structured_outputs")


def _strip_comments(text: str) -> str:
    out = []
    for line in text.splitlines():
        cut = _comment_start(line)
        out.append(line if cut is None else line[:cut])
    return "\n".join(out)


def _comment_start(line: str) -> int | None:
    """Where a // comment starts outside literals and regexes, or None."""
    i, quote = 0, None
    while i < len(line):
        c = line[i]
        if quote is not None:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif line.startswith("//", i):
            return i
        elif c in "\"'":
            quote = c
        i += 1
    return None


def _literal(token: str) -> str:
    if token.endswith("i"):
        raise _refuse(f"a case-insensitive literal ({token})")
    body = token[1:-1]
    if token[0] == "'":  # the same text in double quotes
        body = body.replace("\\'", "'").replace('"', '\\"')
    return f'"{body}"'


def _range_class(low: str, high: str) -> str:
    a, b = json.loads(_literal(low)), json.loads(_literal(high))
    if len(a) != 1 or len(b) != 1:
        raise _refuse(f"a range between strings that are not one character ({low}..{high})")
    escape = {"\\": "\\\\", "]": "\\]", "-": "\\-", "^": "\\^", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return f"[{escape.get(a, a)}-{escape.get(b, b)}]"


def _expansion(text: str, names: dict[str, str]) -> str:
    tokens = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise _refuse(f"syntax this converter does not read ({text[pos:pos + 20]!r})")
        pos = m.end()
        kind = m.lastgroup
        value = m.group()
        if kind == "space" or kind == "alias":
            continue
        if kind == "regex":
            raise _refuse(f"a regular expression ({value})")
        tokens.append((kind, value))
    out: list[str] = []
    optional_depth = []
    i = 0
    while i < len(tokens):
        kind, value = tokens[i]
        if kind == "string" and i + 2 < len(tokens) and tokens[i + 1][0] == "range" and tokens[i + 2][0] == "string":
            out.append(_range_class(value, tokens[i + 2][1]))
            i += 3
            continue
        if kind == "string":
            out.append(_literal(value))
        elif kind == "name":
            out.append(names.get(value, value))
        elif kind == "repeat":
            bounds = [b.strip() for b in value[1:].split("..")]
            out[-1:] = [f"{out[-1]}{{{','.join(bounds)}}}" if out else value]
        elif value == "[":  # Lark's optional, not a character class
            optional_depth.append(len(out))
            out.append("(")
        elif value == "]":
            if not optional_depth:
                raise _refuse("an unbalanced ]")
            optional_depth.pop()
            out.append(")?")
        elif kind == "range":
            raise _refuse("a range (..) between things that are not literals")
        else:
            out.append(value)
        i += 1
    if optional_depth:
        raise _refuse("an unbalanced [")
    return " ".join(out)


def _common_imports(spec: str) -> list[str]:
    """`common.NAME` or `common (NAME, ...)`: the names, each one of _COMMON."""
    m = re.fullmatch(r"common\s*\(([^)]*)\)|common\.([A-Za-z_][A-Za-z0-9_]*)", spec)
    names = [] if m is None else [n for n in re.split(r"[\s,]+", m.group(1) or m.group(2)) if n]
    unknown = [n for n in names if n not in _COMMON]
    if m is None or unknown:
        raise _refuse(f"an import other than Lark's common terminals ({unknown[0] if unknown else spec})")
    return names


def lark_to_ebnf(grammar: str) -> str:
    """The EBNF of a Lark grammar (see the module's docstring for what it covers)."""
    definitions: list[tuple[str, list[str]]] = []
    imports: list[str] = []
    for raw in _strip_comments(grammar).splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("%import"):
            imports += _common_imports(line[len("%import"):].strip())
            continue
        if line.startswith("%"):
            raise _refuse(f"the directive {line.split()[0]}")
        m = _DEFINITION.match(line)
        if m is not None:
            if "{" in m.group(1):
                raise _refuse("a template")
            definitions.append((m.group(1), [line[m.end():]]))
        elif line.startswith("|") and definitions:
            definitions[-1][1].append(line)
        else:
            raise _refuse(f"a line that is neither a definition nor a continuation ({line[:40]!r})")
    if not definitions:
        raise InvalidInputError("structured_outputs: the Lark grammar defines no rule", param="structured_outputs")
    defined = {name for name, _ in definitions}
    start = "start" if "start" in defined else definitions[0][0]
    names = {start: "root"}
    if "root" in defined and start != "root":
        names["root"] = "root_"
    rules = [f"{names.get(name, name)} ::= {_expansion(' '.join(body), names)}" for name, body in definitions]
    rules += [f"{name} ::= {_COMMON[name]}" for name in dict.fromkeys(imports) if name not in defined]
    return "\n".join(rules)
