"""EngineCoreOutputs -> RequestOutputs: incremental detokenization, stop strings, logprobs, n > 1.

Runs in the frontend (the LLM's process, or the API server), never in the engine's hot loop.
Stop strings are found here, on text; the engine, which only sees token ids, is then told to abort the
request, and whatever it still sends for it is dropped here. A request whose output cannot be processed
(its detokenization raises) is finished the same way, with "error" and the reason.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any

from stepahead.core.sched_output import EngineCoreOutput, PromptLogprobs, TokenLogprobs
from stepahead.outputs import CompletionOutput, Logprob, RequestOutput
from stepahead.request import Request
from stepahead.sampling_params import SamplingParams
from stepahead.validation import InvalidInputError

logger = logging.getLogger(__name__)

# Prompt tokens decoded in front of the first output token, so that a leading space or a
# multi-byte character that started in the prompt comes out right.
_PROMPT_CONTEXT_TOKENS = 5


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every RequestOutput holds everything so far
    DELTA = 1  # only what is new since the last one (streaming)
    FINAL_ONLY = 2  # one RequestOutput, when the request has finished


def fast_decoder(tokenizer: Any) -> Any:
    """tokenizer.decode, minus transformers' per-call wrapper where that wrapper adds nothing.

    Detokenization runs twice per token per request on the engine's thread; the wrapper costs 3x
    the decode itself. Only a plain TokenizersBackend without space clean-up takes the short cut.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if (type(tokenizer).__name__ == "TokenizersBackend" and backend is not None
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return backend.decode
    return tokenizer.decode


def _joining_adjacent_special(decode: Any, added_ids: set[int]) -> Any:
    """decode, with each added token that follows another decoded apart from it, so that no space
    comes between the two (spaces_between_special_tokens False)."""
    if not added_ids:
        return decode

    def joined(ids: list[int], **kwargs: Any) -> str:
        cuts = [i for i in range(1, len(ids)) if ids[i] in added_ids and ids[i - 1] in added_ids]
        bounds = [0, *cuts, len(ids)]
        return "".join(decode(ids[a:b], **kwargs) for a, b in zip(bounds, bounds[1:], strict=False))

    return joined


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting only complete characters.

    Decodes a short window twice (before and after the new tokens) and emits the difference; a
    window ending in U+FFFD is an incomplete UTF-8 sequence (byte-level BPE splits characters
    across tokens) and waits for the next token.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True) -> None:
        self._decode = fast_decoder(tokenizer)
        if not (skip_special_tokens or spaces_between_special_tokens):
            self._decode = _joining_adjacent_special(self._decode, set(getattr(tokenizer, "added_tokens_decoder", ())))
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def append(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text, full_text = self._decode_window()
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        # Keep the window short: it restarts at the tokens just emitted.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end of the output: text still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text, full_text = self._decode_window()
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text):]

    def _decode_window(self) -> tuple[str, str]:
        """The window's text without and with the tokens not emitted yet."""
        ids, start = self._ids, self._prefix_offset
        return (self._decode(ids[start:self._read_offset], skip_special_tokens=self._skip),
                self._decode(ids[start:], skip_special_tokens=self._skip))


@dataclass
class _Completion:
    """One child (engine request) of a parent request."""

    index: int
    engine_id: str
    params: SamplingParams
    detok: IncrementalDetokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # What the last DELTA output already carried.
    sent_text: int = 0
    sent_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def visible_text_len(self) -> int:
        """While unfinished, hold back text a stop string may still begin in (it would be cut)."""
        if self.finished or not self.params.stop:
            return len(self.text)
        hold = max(len(stop) for stop in self.params.stop) - 1
        return max(self.sent_text, len(self.text) - hold)


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    children: list[_Completion]
    num_cached_tokens: int = 0
    # With prompt logprobs asked: one entry per prompt position (position 0 stays None), filled as the
    # steps that compute them report; a recompute after preemption writes the same values again.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_prompt_logprobs: int = 0  # entries filled
    sent_prompt_logprobs: bool = False  # a DELTA output carried them
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(child.finished for child in self.children)

    def complete_prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """Every position's prompt logprobs once all have arrived, else None."""
        lps = self.prompt_logprobs
        if lps is None or self.num_prompt_logprobs < len(lps) - 1:
            return None
        return list(lps)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, _Completion]] = {}  # engine request id -> owner
        self._token_texts: dict[int, str] = {}  # at most the vocabulary

    def add_request(
        self,
        request_id: str,
        engine_requests: list[Request],
        prompt: str | None,
        output_kind: RequestOutputKind,
    ) -> None:
        if request_id in self._parents:
            raise InvalidInputError(f"request_id {request_id!r} is already in use", param="request_id")
        prompt_ids = engine_requests[0].prompt_token_ids
        children = []
        for index, req in enumerate(engine_requests):
            params = req.sampling_params
            children.append(_Completion(
                index=index,
                engine_id=req.request_id,
                params=params,
                detok=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens,
                                             params.spaces_between_special_tokens),
                logprobs=[] if params.logprobs is not None else None,
            ))
        parent = _Parent(request_id, prompt, prompt_ids, output_kind, children)
        if engine_requests[0].sampling_params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_ids)
        self._parents[request_id] = parent
        for child in children:
            self._children[child.engine_id] = (parent, child)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def abort_request(self, request_id: str) -> list[str]:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        for child in parent.children:
            self._children.pop(child.engine_id, None)
        return [child.engine_id for child in parent.children if not child.finished]

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """RequestOutputs keyed by parent id, in order of first appearance; engine ids to abort."""
        changed: dict[str, tuple[_Parent, set[int]]] = {}
        to_abort: list[str] = []
        for output in outputs:
            owner = self._children.get(output.request_id)
            if owner is None:
                continue  # aborted, or already finished here by a stop string
            parent, child = owner
            if output.num_cached_tokens:
                parent.num_cached_tokens = output.num_cached_tokens
            if output.first_scheduled_time is not None and parent.first_scheduled_time is None:
                parent.first_scheduled_time = output.first_scheduled_time
            if output.new_prompt_logprobs is not None:
                self._add_prompt_logprobs(parent, output.new_prompt_logprobs)
            if self._update_child_or_fail(child, output):
                to_abort.append(child.engine_id)
            if child.finished:
                del self._children[child.engine_id]
            changed.setdefault(parent.request_id, (parent, set()))[1].add(child.index)

        results = []
        for parent, indices in changed.values():
            finished = parent.finished
            if finished:
                del self._parents[parent.request_id]
            request_output = self._make_output(parent, indices, finished)
            if request_output is not None:
                results.append(request_output)
        return results, to_abort

    # -- per child --------------------------------------------------------------------------------

    def _update_child_or_fail(self, child: _Completion, output: EngineCoreOutput) -> bool:
        """_update_child; if detokenizing (or anything else here) raises, this child alone finishes
        with "error" and the reason, and the engine is told to stop it."""
        try:
            return self._update_child(child, output)
        except Exception as e:  # one request's output fails that request alone
            logger.error("request %s: processing its output failed: %r", child.engine_id, e)
            child.finish_reason, child.stop_reason = "error", f"processing the output failed: {e!r}"
            return not output.finished

    def _update_child(self, child: _Completion, output: EngineCoreOutput) -> bool:
        """Apply one step's news; True when a stop string finished a request the engine still runs.

        With stop strings, a step's tokens (several where drafts were accepted) are taken one at a time:
        the first that completes a stop string ends the output, and those after it are dropped, as
        plain decoding would never have sampled them (a stop token among them included)."""
        new_ids = output.new_token_ids
        # A stop token (EOS or stop_token_ids) ends the output but is not part of its text.
        stopped_on_token = output.finish_reason == "stop" and not isinstance(output.stop_reason, str)
        pieces = [[token] for token in new_ids] if child.params.stop and new_ids else [new_ids]
        taken = 0
        for piece in pieces:
            taken += len(piece)
            child.token_ids.extend(piece)
            if child.logprobs is not None and output.new_logprobs:
                piece_logprobs = output.new_logprobs[taken - len(piece):taken]
                child.logprobs.extend(self._logprob_dict(token_logprobs) for token_logprobs in piece_logprobs)
            last = taken == len(new_ids)
            on_stop_token = last and stopped_on_token
            text_ids = piece[:-1] if on_stop_token and piece and not child.params.include_stop_str_in_output \
                else piece
            old_len = len(child.text)
            child.text += child.detok.append(text_ids)
            if last and output.finished:
                child.text += child.detok.flush()
            if not on_stop_token and child.params.stop and self._check_stop_strings(child, old_len):
                return not output.finished
        if output.finished:
            child.finish_reason = output.finish_reason
            child.stop_reason = output.stop_reason
        return False

    @staticmethod
    def _check_stop_strings(child: _Completion, old_len: int) -> bool:
        """Finish the child on the earliest stop string in its new text; truncate the text there."""
        best: tuple[int, str] | None = None
        for stop in child.params.stop or ():  # a list since SamplingParams.__post_init__
            pos = child.text.find(stop, max(0, old_len - len(stop) + 1))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        pos, stop = best
        end = pos + len(stop) if child.params.include_stop_str_in_output else pos
        child.text = child.text[:end]
        child.finish_reason = "stop"
        child.stop_reason = stop
        return True

    def _add_prompt_logprobs(self, parent: _Parent, run: PromptLogprobs) -> None:
        lps = parent.prompt_logprobs
        if lps is None:
            return
        for position, entry in enumerate(run.entries, start=run.start):
            if 0 < position < len(lps):
                if lps[position] is None:
                    parent.num_prompt_logprobs += 1
                lps[position] = self._logprob_dict(entry)

    def _token_text(self, token_id: int) -> str:
        """One token decoded alone; cached, since the same ids recur in every top-N list (a prompt's
        logprobs are hundreds of thousands of them) and this runs on the server's event loop."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprob_dict(self, token_logprobs: TokenLogprobs) -> dict[int, Logprob]:
        """The sampled token (first, with its true rank) plus the top-N ranked 1..N."""
        decode = self._token_text
        sampled = token_logprobs.token_ids[0]
        entries = {sampled: Logprob(token_logprobs.logprobs[0], token_logprobs.sampled_rank, decode(sampled))}
        top_n = zip(token_logprobs.token_ids[1:], token_logprobs.logprobs[1:], strict=True)
        for rank, (token_id, value) in enumerate(top_n, start=1):
            if token_id not in entries:
                entries[token_id] = Logprob(value, rank, decode(token_id))
        return entries

    # -- assembly ----------------------------------------------------------------------------------

    def _make_output(self, parent: _Parent, changed: set[int], finished: bool) -> RequestOutput | None:
        kind = parent.kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind is RequestOutputKind.DELTA:
            completions = [self._delta(child) for child in parent.children if child.index in changed]
        else:
            completions = [self._cumulative(child) for child in parent.children]
        prompt_logprobs = parent.complete_prompt_logprobs()
        if kind is RequestOutputKind.DELTA:  # sent once, with the first output that has them all
            if parent.sent_prompt_logprobs:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                parent.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            first_scheduled_time=parent.first_scheduled_time,
        )

    @staticmethod
    def _cumulative(child: _Completion) -> CompletionOutput:
        return CompletionOutput(
            index=child.index,
            text=child.text[:child.visible_text_len()],
            token_ids=list(child.token_ids),
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason,
            logprobs=None if child.logprobs is None else list(child.logprobs),
        )

    @staticmethod
    def _delta(child: _Completion) -> CompletionOutput:
        visible = child.visible_text_len()
        text = child.text[child.sent_text:visible]
        tokens = child.token_ids[child.sent_tokens:]
        logprobs = None if child.logprobs is None else child.logprobs[child.sent_tokens:]
        child.sent_text, child.sent_tokens = visible, len(child.token_ids)
        return CompletionOutput(
            index=child.index,
            text=text,
            token_ids=tokens,
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason,
            logprobs=logprobs,
        )
