"""disable_any_whitespace: a JSON grammar compiled compact, with no whitespace between tokens (the
default allows any), checked through xgrammar's real matcher and on the tiny random model; the
whitespace options with a constraint they do not shape, and whitespace_pattern, are refused by name."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr

from stepahead import LLM, SamplingParams
from stepahead.request import Request
from stepahead.sampling_params import StructuredOutputsParams as Constraint
from stepahead.structured_output import grammar_spec, validate_structured_outputs
from stepahead.structured_output.compiler import GrammarCompiler
from stepahead.validation import InvalidInputError
from tests.structured_output.conftest import has_whitespace_outside_strings

# Booleans and an enum: the grammar allows finitely many texts but for whitespace, so a random model ends
# it once it cannot pad.
FLAGS = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
         "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(model_config, tokenizer):
    return GrammarCompiler(lambda: tokenizer, model_config.vocab_size, [model_config.eos_token_id])


def _accepts(compiler, model_config, constraint: Constraint, text: str) -> bool:
    """The whole text, then the end token: the grammar takes exactly this output."""
    matcher = xgr.GrammarMatcher(compiler.compile(validate_structured_outputs(constraint)))
    return matcher.accept_string(text) and matcher.accept_token(model_config.eos_token_id)


@pytest.mark.parametrize("constraint", [Constraint(json=FLAGS), Constraint(json_object=True)])
@pytest.mark.parametrize("text", ['{"ok":true,"n":2}', '{"ok": true, "n": 2}', '{ "ok" : true ,\n"n":2 }'])
def test_compact_json_takes_no_whitespace_between_tokens(compiler, model_config, constraint, text):
    compact = Constraint(**{constraint.kind: getattr(constraint, constraint.kind)}, disable_any_whitespace=True)
    assert _accepts(compiler, model_config, constraint, text)
    assert _accepts(compiler, model_config, compact, text) == (not has_whitespace_outside_strings(text))


def test_whitespace_in_strings_stays_allowed(compiler, model_config):
    compact = Constraint(json={"type": "object", "properties": {"s": {"type": "string"}}}, disable_any_whitespace=True)
    assert _accepts(compiler, model_config, compact, '{"s":"two words\\tand a tab"}')


def test_the_option_is_part_of_the_grammar_cache_key(manager):
    assert grammar_spec(Constraint(json=FLAGS)) != grammar_spec(Constraint(json=FLAGS, disable_any_whitespace=True))
    requests = [Request(f"r{i}", [1, 2], SamplingParams(
                    structured_outputs=Constraint(json=FLAGS, disable_any_whitespace=i > 0)), eos_token_id=2)
                for i in range(3)]
    for request in requests:
        manager.submit(request)
    assert manager.num_compiles == 2
    assert requests[1].structured_output.compiled is requests[2].structured_output.compiled


def test_the_tiny_random_model_writes_compact_json_only_when_asked(tiny_llama):
    """Free to, the random model pads JSON with whitespace until max_tokens; compact, it writes the object."""
    prompts = ["hello", "def main():", "The answer"]
    with LLM(str(tiny_llama), executor="uni", max_model_len=128) as llm:
        def texts(compact: bool) -> list:
            params = SamplingParams(max_tokens=40, temperature=0.8, seed=3,
                                    structured_outputs=Constraint(json=FLAGS, disable_any_whitespace=compact))
            return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

        free, compact = texts(False), texts(True)
    assert any(has_whitespace_outside_strings(out.text) for out in free)
    for out in compact:
        assert out.finish_reason == "stop" and not has_whitespace_outside_strings(out.text), out.text
        jsonschema.validate(json.loads(out.text), FLAGS)


@pytest.mark.parametrize("kwargs, phrase", [
    ({"regex": "[a-z]+", "disable_any_whitespace": True}, "disable_any_whitespace applies to json and json_object "
                                                          "only, not to regex"),
    ({"choice": ["a", "b"], "disable_any_whitespace": True}, "disable_any_whitespace applies to json"),
    ({"grammar": 'root ::= "a"', "disable_any_whitespace": True}, "disable_any_whitespace applies to json"),
    ({"structural_tag": {"format": {"type": "const_string", "value": "a"}}, "disable_any_whitespace": True},
     "not to structural_tag"),
    ({"json": FLAGS, "disable_any_whitespace": "yes"}, "disable_any_whitespace must be true or false"),
    ({"regex": "[a-z]+", "whitespace_pattern": " ?"}, "whitespace_pattern applies to json and json_object only"),
    ({"json": FLAGS, "whitespace_pattern": " ?"}, "whitespace_pattern is not supported by the xgrammar backend"),
    ({"json_object": True, "whitespace_pattern": ""}, "whitespace_pattern is not supported"),
])
def test_whitespace_options_are_refused_by_name_where_they_cannot_apply(kwargs, phrase):
    with pytest.raises(InvalidInputError, match=phrase) as raised:
        Constraint(**kwargs)
    assert raised.value.param == "structured_outputs"
