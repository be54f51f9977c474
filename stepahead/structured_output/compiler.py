"""Grammars compiled against the model's vocabulary with xgrammar.

The vocabulary (xgrammar's TokenizerInfo) is built once, on the first compile, from the model's
tokenizer; its size is the model's logits width, so ids the tokenizer lacks are never allowed. The
stop tokens are the model's end tokens: a grammar that is complete allows only them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from stepahead.structured_output.grammar_spec import GrammarSpec
from stepahead.structured_output.structural_tag import xgrammar_structural_tag

# JSON's layout: any whitespace between tokens (vLLM's default), or none (disable_any_whitespace).
# Without any whitespace xgrammar's default separators are json.dumps' ", " and ": ", so compact JSON
# names its own.
_ANY_WHITESPACE: dict[str, Any] = {"any_whitespace": True}
_COMPACT: dict[str, Any] = {"any_whitespace": False, "separators": (",", ":")}


class GrammarCompiler:
    """Compiles GrammarSpecs. Not thread-safe on its own: the manager calls it from one thread."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: Sequence[int],
                 *, max_threads: int = 2) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_threads = max_threads
        self._compiler: Any = None

    def _xgrammar_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._load_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None)
            # The manager caches compiled grammars per spec; xgrammar's own cache would hold them twice.
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)
        return self._compiler

    def compile(self, spec: GrammarSpec) -> Any:
        """An xgrammar CompiledGrammar; raises RuntimeError (xgrammar's) or ValueError on a spec it
        cannot compile."""
        compiler = self._xgrammar_compiler()
        layout = _ANY_WHITESPACE if spec.any_whitespace else _COMPACT
        if spec.kind == "json":
            return compiler.compile_json_schema(spec.text, **layout)
        if spec.kind == "json_object":
            # OpenAI's json_object promises an object; xgrammar's built-in JSON grammar also allows arrays.
            return compiler.compile_json_schema('{"type": "object"}', **layout)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(xgrammar_structural_tag(spec.text))
        return compiler.compile_grammar(spec.text)
