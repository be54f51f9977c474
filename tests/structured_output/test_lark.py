"""Grammars in Lark's syntax: converted to EBNF (vLLM accepts both), the same constraint as the EBNF
written by hand, and what has no EBNF equivalent refused by name."""

from __future__ import annotations

import re

import pytest

from stepahead import LLM, SamplingParams
from stepahead.sampling_params import StructuredOutputsParams
from stepahead.structured_output.grammar_spec import validate_structured_outputs
from stepahead.structured_output.lark import is_likely_lark, lark_to_ebnf
from stepahead.validation import InvalidInputError

LARK = r"""
// an answer and a number
?start: answer
answer: "The answer is " NUMBER unit? "." -> done
      | 'No' [" idea"] "."
unit: " " ("cm" | "kg")
NUMBER: "0".."9"~1..3
"""
EBNF = """root ::= answer
answer ::= "The answer is " NUMBER unit ? "." | "No" ( " idea" )? "."
unit ::= " " ( "cm" | "kg" )
NUMBER ::= [0-9]{1,3}"""
OUTPUT = re.compile(r"(The answer is [0-9]{1,3}( (cm|kg))?|No( idea)?)\.")


def test_conversion():
    assert is_likely_lark(LARK) and not is_likely_lark(EBNF)
    assert lark_to_ebnf(LARK) == EBNF


def test_common_imports_and_ranges():
    ebnf = lark_to_ebnf('start: "[" SIGNED_NUMBER ("," WS? SIGNED_NUMBER)* "]"\n%import common (SIGNED_NUMBER, WS)')
    assert ebnf.startswith('root ::= "[" SIGNED_NUMBER ( "," WS ? SIGNED_NUMBER ) * "]"')
    assert "SIGNED_NUMBER ::= " in ebnf and "WS ::= " in ebnf
    validate_structured_outputs(StructuredOutputsParams(grammar=LARK))  # xgrammar parses the converted text


@pytest.mark.parametrize("grammar,what", [
    ('start: /[a-z]+/', "a regular expression"),
    ('start: WORD\n%ignore " "', "the directive %ignore"),
    ('start: "yes"i', "a case-insensitive literal"),
    ('start: x\n%import python.NAME', "an import other than"),
    ('start: "a".."zz"', "not one character"),
    ('start: ["a"', "an unbalanced ["),
])
def test_what_ebnf_cannot_say_is_refused_by_name(grammar, what):
    with pytest.raises(InvalidInputError, match=re.escape(what)) as raised:
        validate_structured_outputs(StructuredOutputsParams(grammar=grammar))
    assert "Lark grammar" in str(raised.value) and raised.value.param == "structured_outputs"


def test_lark_constrains_like_its_ebnf(tiny_llama):
    prompts = ["hello", "def main():", "The answer"]
    with LLM(str(tiny_llama), executor="uni", max_model_len=128) as llm:
        outs = {name: [o.outputs[0] for o in llm.generate(prompts, SamplingParams(
                    max_tokens=30, temperature=0.8, seed=3, structured_outputs=StructuredOutputsParams(grammar=g)),
                    use_tqdm=False)]
                for name, g in (("lark", LARK), ("ebnf", EBNF))}
    assert [o.token_ids for o in outs["lark"]] == [o.token_ids for o in outs["ebnf"]]
    for out in outs["lark"]:
        assert out.finish_reason == "stop" and OUTPUT.fullmatch(out.text), out.text
