"""The scheduler's grammar hook: compiles off the engine's path, one matcher per request, a bitmask per step.

A request's grammar compiles on a background thread while the request waits in WAITING_FOR_GRAMMAR;
other requests keep running. Equal specs share one compile (an LRU of futures). A matcher advances
only with tokens that became the request's output (update_from_output hands it exactly those), so
its state always equals the output so far: a preempted request resumes with its matcher as it was,
stale output is accepted when delivered and dropped output never reaches it. Nothing is ever
accepted ahead of the output, so nothing needs rolling back.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from stepahead.request import Request
from stepahead.structured_output.compiler import GrammarCompiler
from stepahead.structured_output.grammar_spec import GrammarSpec, compiler_message, grammar_spec

MAX_CACHED_GRAMMARS = 128


@dataclass
class RequestGrammar:
    """One request's grammar: its compile (shared by requests with an equal spec) and its matcher."""

    compiled: Future
    matcher: Any = None  # xgrammar GrammarMatcher, made on first use
    num_accepted_tokens: int = 0


class StructuredOutputManager:
    """Owns the compile thread, the compiled-grammar cache and the batch bitmask filler."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: Sequence[int],
                 *, any_whitespace: bool = True) -> None:
        threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        self._compiler = GrammarCompiler(load_tokenizer, vocab_size, stop_token_ids,
                                         any_whitespace=any_whitespace, max_threads=threads)
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        # One thread: compiles run in order and the compiler needs no lock; xgrammar parallelizes inside.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stepahead-grammar")
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._batch_matcher: Any = None
        self._fill_threads = threads
        self.num_compiles = 0

    # -- compiling ------------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Start compiling the request's grammar (or share an equal spec's compile)."""
        spec = grammar_spec(request.sampling_params.structured_outputs)
        future = self._cache.get(spec)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self._compiler.compile, spec)
            self.num_compiles += 1
            self._cache[spec] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(spec)
        request.structured_output = RequestGrammar(future)

    @staticmethod
    def is_ready(request: Request) -> bool:
        return request.structured_output.compiled.done()

    @staticmethod
    def wait_for_any(requests: list[Request], timeout: float) -> None:
        futures.wait([r.structured_output.compiled for r in requests], timeout, futures.FIRST_COMPLETED)

    @staticmethod
    def compile_error(request: Request) -> str | None:
        """Why a finished compile failed, or None."""
        error = request.structured_output.compiled.exception()
        return None if error is None else f"grammar failed to compile: {compiler_message(error)}"

    # -- matching -------------------------------------------------------------------------------

    @staticmethod
    def _matcher(grammar: RequestGrammar) -> Any:
        if grammar.matcher is None:
            import xgrammar as xgr

            grammar.matcher = xgr.GrammarMatcher(grammar.compiled.result())
        return grammar.matcher

    def accept_tokens(self, request: Request, token_ids: list[int]) -> bool:
        """Advance the matcher; False if the grammar rejects a token (the request then fails)."""
        grammar = request.structured_output
        matcher = self._matcher(grammar)
        for token_id in token_ids:
            if not matcher.accept_token(token_id):
                return False
            grammar.num_accepted_tokens += 1
        return True

    @staticmethod
    def is_terminated(request: Request) -> bool:
        """The grammar is complete and has accepted an end token: nothing more may follow."""
        matcher = request.structured_output.matcher
        return matcher is not None and matcher.is_terminated()

    def grammar_bitmask(self, requests: list[Request]) -> np.ndarray:
        """int32 [len(requests), ceil(vocab/32)]: bit j of word w of row i allows token 32*w + j for requests[i]."""
        import torch
        import xgrammar as xgr

        bitmask = torch.full((len(requests), self.num_words), -1, dtype=torch.int32)
        matchers = [self._matcher(r.structured_output) for r in requests]
        live = [i for i, m in enumerate(matchers) if not m.is_terminated()]  # a terminated one has finished
        if len(live) == 1:
            matchers[live[0]].fill_next_token_bitmask(bitmask, live[0])
        elif live:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher(self._fill_threads)
            self._batch_matcher.batch_fill_next_token_bitmask([matchers[i] for i in live], bitmask, live)
        return bitmask.numpy()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
