"""The scheduler's grammar hook: compiles off the engine's path, one matcher per request, a bitmask per step.

A request's grammar compiles on a background thread while the request waits in WAITING_FOR_GRAMMAR;
other requests keep running. Equal specs share one compile (an LRU of futures). A matcher advances
only with tokens that became the request's output (update_from_output hands it exactly those), so
its state always equals the output so far: a preempted request resumes with its matcher as it was,
stale output is accepted when delivered and dropped output never reaches it. Only a step's drafts
are accepted ahead of the output, to check them and mask each draft position, and are rolled back at
once. A request with a reasoning gate (reasoning_gate.py) hands its matcher only the tokens after its
reasoning, and its rows allow every token until then (its drafts are followed through the one that
ends the reasoning; after that, through the grammar, as any request's).

A failure is the request's own: a compile that fails or outlasts MAX_COMPILE_S, or a matcher that
raises, fails that request with the reason, and the others go on.
"""

from __future__ import annotations

import copy
import os
import time
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
from stepahead.structured_output.reasoning_gate import Phase, ReasoningGate

MAX_CACHED_GRAMMARS = 128
# A request whose grammar has not compiled this long after it arrived fails (the compile itself cannot
# be stopped; grammar_bounds keeps specs small enough that this is a backstop).
MAX_COMPILE_S = 60.0


@dataclass
class RequestGrammar:
    """One request's grammar: its compile (shared by requests with an equal spec) and its matcher."""

    compiled: Future
    deadline: float  # time.monotonic() by which the compile must have finished
    matcher: Any = None  # xgrammar GrammarMatcher, made on first use
    num_accepted_tokens: int = 0
    reasoning: ReasoningGate | None = None  # the grammar waits for the reasoning to end


class StructuredOutputManager:
    """Owns the compile thread, the compiled-grammar cache and the batch bitmask filler."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        self._compiler = GrammarCompiler(load_tokenizer, vocab_size, stop_token_ids, max_threads=threads)
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
        params = request.sampling_params.structured_outputs
        assert params is not None, "submit is for structured requests"
        spec = grammar_spec(params)
        future = self._cache.get(spec)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self._compiler.compile, spec)
            self.num_compiles += 1
            self._cache[spec] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(spec)
        request.structured_output = RequestGrammar(future, time.monotonic() + MAX_COMPILE_S,
                                                   reasoning=ReasoningGate.of(params))

    @staticmethod
    def is_ready(request: Request) -> bool:
        """Compiled, failed, or out of time (compile_error says which)."""
        grammar = request.structured_output
        return grammar.compiled.done() or time.monotonic() > grammar.deadline

    @staticmethod
    def wait_for_any(requests: list[Request], timeout: float) -> None:
        futures.wait([r.structured_output.compiled for r in requests], timeout, futures.FIRST_COMPLETED)

    @staticmethod
    def compile_error(request: Request) -> str | None:
        """Why a compile failed or is out of time, or None once it has succeeded."""
        compiled = request.structured_output.compiled
        if not compiled.done():
            return f"the grammar did not compile within {MAX_COMPILE_S:g} s (the compile time limit)"
        error = compiled.exception()
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
        if grammar.reasoning is not None:
            token_ids = grammar.reasoning.feed(token_ids)
            if not token_ids:
                return True
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

    def grammar_bitmask(self, requests: list[Request]) -> tuple[np.ndarray, dict[str, str]]:
        """int32 [len(requests), ceil(vocab/32)]: bit j of word w of row i allows token 32*w + j for
        requests[i]; and {request id: reason} for the requests whose matcher failed (their rows allow
        everything: the caller fails those requests, so nothing sampled for them is ever delivered)."""
        import torch

        bitmask = torch.full((len(requests), self.num_words), -1, dtype=torch.int32)
        failed: dict[str, str] = {}
        live: list[int] = []
        matchers: list[Any] = []
        forced: dict[int, int] = {}  # row -> the one token it allows (the rest of a start marker)
        markers: dict[int, int] = {}  # row -> a start marker's first token, allowed besides the grammar's
        for i, request in enumerate(requests):
            gate = request.structured_output.reasoning
            if gate is not None and not gate.constrained:
                token = gate.forced_token()
                marker = gate.marker_token()
                if token is not None:
                    forced[i] = token
                if marker is None:  # reasoning (all allowed) or a forced row: no grammar here
                    matchers.append(None)
                    continue
                markers[i] = marker
            try:
                matcher = self._matcher(request.structured_output)
                if not matcher.is_terminated():  # a terminated one has finished
                    live.append(i)
                matchers.append(matcher)
            except Exception as e:  # one request's grammar fails that request alone
                failed[request.request_id] = f"the grammar matcher failed: {e!r}"
                matchers.append(None)
        try:
            self._fill(bitmask, matchers, live)
        except Exception:  # find the matcher at fault, one at a time
            for i in live:
                try:
                    matchers[i].fill_next_token_bitmask(bitmask, i)
                except Exception as e:
                    bitmask[i] = -1
                    failed[requests[i].request_id] = f"the grammar matcher failed: {e!r}"
        rows = bitmask.numpy()
        bits = rows.view(np.uint32)
        for i, token in forced.items():
            rows[i] = 0
            bits[i, token >> 5] = np.uint32(1 << (token & 31))
        for i, token in markers.items():
            bits[i, token >> 5] |= np.uint32(1 << (token & 31))
        return rows, failed

    def grammatical_prefix(self, request: Request, draft_token_ids: list[int]) -> int:
        """How many of the drafts, in order, the grammar accepts after the output so far (the matcher is
        left as it was). A draft that would complete the grammar ends the prefix: an end token is only
        ever the step's own sample, as in plain decoding."""
        gate = request.structured_output.reasoning
        if gate is not None and not gate.constrained:  # the gate, not the matcher, decides
            return len(self._reasoning_prefix(gate, draft_token_ids)[0])
        matcher = self._matcher(request.structured_output)
        kept = 0
        for token in draft_token_ids:
            if not matcher.accept_token(token):
                break
            if matcher.is_terminated():
                matcher.rollback(1)
                break
            kept += 1
        if kept:
            matcher.rollback(kept)
        return kept

    def draft_bitmask(self, requests: list[Request],
                      drafts: list[list[int]]) -> tuple[np.ndarray, list[list[int]], dict[str, str]]:
        """The bitmask of a step that verifies drafts: per request, the row of its next token, then one
        row after each draft in its grammatical prefix (the matcher advanced through them, then rolled
        back), so every position is masked as plain constrained decoding would mask it there. Returns the
        rows (packed, request after request), each request's drafts that its rows follow, and the
        requests whose matcher failed (as grammar_bitmask)."""
        import torch

        bitmask = torch.full((sum(1 + len(d) for d in drafts), self.num_words), -1, dtype=torch.int32)
        followed: list[list[int]] = []
        failed: dict[str, str] = {}
        row = 0
        for request, request_drafts in zip(requests, drafts, strict=True):
            kept: list[int] = []
            gate = request.structured_output.reasoning
            if gate is not None and not gate.constrained:
                kept = self._reasoning_rows(request, request_drafts, bitmask, row, failed)
                followed.append(kept)
                row += 1 + len(kept)
                continue
            try:
                matcher = self._matcher(request.structured_output)
                if not matcher.is_terminated():  # a terminated one has finished: its row allows everything
                    kept = request_drafts[:self.grammatical_prefix(request, request_drafts)]
                    matcher.fill_next_token_bitmask(bitmask, row)
                    for j, token in enumerate(kept):
                        matcher.accept_token(token)
                        matcher.fill_next_token_bitmask(bitmask, row + 1 + j)
                    if kept:
                        matcher.rollback(len(kept))
            except Exception as e:  # one request's grammar fails that request alone
                bitmask[row:row + 1 + len(kept)] = -1
                failed[request.request_id] = f"the grammar matcher failed: {e!r}"
            followed.append(kept)
            row += 1 + len(kept)
        return bitmask[:row].numpy(), followed, failed

    @staticmethod
    def _reasoning_prefix(gate: ReasoningGate, drafts: list[int]) -> tuple[list[int], bool]:
        """The drafts a request still reasoning may follow, and whether the last of them ends the
        reasoning: every token is allowed while reasoning, so all of them through the one that ends it
        (the grammar's row follows that one). A gate still reading the start marker follows none."""
        if gate.phase is not Phase.REASONING:
            return [], False
        trial = copy.deepcopy(gate)  # the gate itself advances only with the output (invariant G1)
        for i, token in enumerate(drafts):
            trial.feed([token])
            if trial.constrained:
                return drafts[:i + 1], True
        return list(drafts), False

    def _reasoning_rows(self, request: Request, drafts: list[int], bitmask: Any, row: int,
                        failed: dict[str, str]) -> list[int]:
        """The rows from `row` on of a request whose grammar waits for its reasoning to end; returns the
        drafts they follow (_reasoning_prefix). The first row is the gate's own (grammar_bitmask's), the
        rows after drafts inside the reasoning allow everything, and the row after the draft that ends
        it is the grammar's first (its matcher has read nothing yet)."""
        import torch

        gate = request.structured_output.reasoning
        assert gate is not None
        (gated,), gate_failed = self.grammar_bitmask([request])
        bitmask[row] = torch.from_numpy(gated)
        failed.update(gate_failed)
        if gate_failed:
            return []
        kept, ended = self._reasoning_prefix(gate, drafts)
        if ended:
            try:
                self._matcher(request.structured_output).fill_next_token_bitmask(bitmask, row + len(kept))
            except Exception as e:  # one request's grammar fails that request alone
                failed[request.request_id] = f"the grammar matcher failed: {e!r}"
        return kept

    def _fill(self, bitmask: Any, matchers: list[Any], live: list[int]) -> None:
        if len(live) == 1:
            matchers[live[0]].fill_next_token_bitmask(bitmask, live[0])
        elif live:
            if self._batch_matcher is None:
                import xgrammar as xgr

                self._batch_matcher = xgr.BatchGrammarMatcher(self._fill_threads)
            self._batch_matcher.batch_fill_next_token_bitmask([matchers[i] for i in live], bitmask, live)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
