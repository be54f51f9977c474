"""Structured outputs: grammars compiled with xgrammar, one matcher per request, a bitmask per step.

grammar_spec.py turns a request's StructuredOutputsParams into a GrammarSpec and checks it when the
request arrives (structural_tag.py reads a structural tag's two forms); compiler.py compiles specs
against the model's vocabulary; manager.py is the scheduler's hook (compile off the engine's path,
advance matchers, fill each step's bitmask).
"""

from stepahead.structured_output.grammar_spec import GrammarSpec, grammar_spec, validate_structured_outputs
from stepahead.structured_output.manager import StructuredOutputManager

BACKENDS = ("xgrammar", "none")

__all__ = ["BACKENDS", "GrammarSpec", "StructuredOutputManager", "grammar_spec", "validate_structured_outputs"]
