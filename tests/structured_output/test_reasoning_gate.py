"""The grammar after the reasoning, with the built-in model's real tokenizer and xgrammar: rows allow
every token while the model thinks, the matcher sees only what follows "</think>", and a qwen3-style
gate reads the output's opening for "<think>" (its first token or the grammar's, then the rest forced)."""

from __future__ import annotations

import json

import pytest

from stepahead.request import Request
from stepahead.sampling_params import SamplingParams
from stepahead.sampling_params import StructuredOutputsParams as Constraint
from stepahead.structured_output.reasoning_gate import Phase, ReasoningGate
from stepahead.validation import InvalidInputError

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _request(manager, tokenizer, start: str | None) -> Request:
    constraint = Constraint(json=SCHEMA, reasoning_end_token_ids=_ids(tokenizer, "</think>"),
                            reasoning_start_token_ids=_ids(tokenizer, start) if start else None)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=64, structured_outputs=constraint), eos_token_id=2)
    manager.submit(request)
    request.structured_output.compiled.result(timeout=60)
    return request


def _allowed(row, vocab_size: int) -> set[int]:
    return {t for t in range(vocab_size) if (int(row[t // 32]) >> (t % 32)) & 1}


def _feed_one_by_one(manager, request, ids: list[int], vocab: int) -> list[set[int]]:
    """Accept the ids a token at a time (as steps deliver them), checking each against its row first."""
    rows = []
    for token in ids:
        (row,), failed = manager.grammar_bitmask([request])
        assert not failed
        rows.append(_allowed(row, vocab))
        assert token in rows[-1], token
        assert manager.accept_tokens(request, [token])
    return rows


def test_free_reasoning_then_the_grammar(manager, tokenizer, model_config):
    vocab = model_config.vocab_size
    request = _request(manager, tokenizer, None)
    thought = _ids(tokenizer, "Not JSON at all: {[ let me think.</think>")
    rows = _feed_one_by_one(manager, request, thought, vocab)
    assert all(len(row) == vocab for row in rows)  # nothing constrained while thinking
    assert request.structured_output.matcher is None  # the grammar has seen nothing yet
    answer = _ids(tokenizer, json.dumps({"ok": True}))
    rows = _feed_one_by_one(manager, request, answer, vocab)
    assert all(len(row) < vocab for row in rows)  # the grammar constrains what follows
    (row,), _ = manager.grammar_bitmask([request])
    assert _allowed(row, vocab) == {model_config.eos_token_id}  # the object is complete
    assert not manager.accept_tokens(request, _ids(tokenizer, "x"))  # and nothing else is accepted


def test_end_marker_split_across_steps_and_text_after_it_in_one_step(manager, tokenizer):
    request = _request(manager, tokenizer, None)
    end = _ids(tokenizer, "</think>")
    assert len(end) > 1  # this tokenizer spells it in pieces: the gate must join them across steps
    assert manager.accept_tokens(request, _ids(tokenizer, "hmm") + end[:1])
    assert request.structured_output.reasoning.phase is Phase.REASONING
    # The rest of the marker and the first JSON token in one step: only the latter reaches the grammar.
    assert manager.accept_tokens(request, end[1:] + _ids(tokenizer, "{"))
    assert request.structured_output.num_accepted_tokens == len(_ids(tokenizer, "{"))
    # A reasoning-time token after the marker is now checked by the grammar, and refused.
    assert not manager.accept_tokens(request, _ids(tokenizer, "hmm"))


def test_qwen3_gate_reads_the_opening(manager, tokenizer, model_config):
    vocab = model_config.vocab_size
    start = _ids(tokenizer, "<think>")
    thinking = _request(manager, tokenizer, "<think>")
    (row,), _ = manager.grammar_bitmask([thinking])
    first = _allowed(row, vocab)
    assert start[0] in first and len(first) < vocab  # the marker's first token or the grammar's
    if len(start) > 1:  # a begun marker must be finished
        assert manager.accept_tokens(thinking, start[:1])
        (row,), _ = manager.grammar_bitmask([thinking])
        assert _allowed(row, vocab) == {start[1]}
        assert manager.accept_tokens(thinking, start[1:])
    else:
        assert manager.accept_tokens(thinking, start)
    assert thinking.structured_output.reasoning.phase is Phase.REASONING
    (row,), _ = manager.grammar_bitmask([thinking])
    assert len(_allowed(row, vocab)) == vocab

    direct = _request(manager, tokenizer, "<think>")
    brace = _ids(tokenizer, "{")
    assert brace[0] != start[0] and manager.accept_tokens(direct, brace)  # no marker: the grammar from the start
    assert direct.structured_output.reasoning.constrained
    assert direct.structured_output.num_accepted_tokens == len(brace)


def test_gate_alone_is_pure_bookkeeping():
    gate = ReasoningGate(end=(7, 8), start=None)
    assert gate.feed([1, 7, 2, 7]) == [] and gate.phase is Phase.REASONING
    assert gate.feed([8, 5, 6]) == [5, 6] and gate.constrained
    opening = ReasoningGate(end=(9,), start=(3, 4))
    assert opening.marker_token() == 3 and opening.forced_token() is None
    assert opening.feed([3]) == [] and opening.forced_token() == 4
    assert opening.feed([5]) == [3, 5] and opening.constrained  # a half marker goes to the grammar


@pytest.mark.parametrize("field", ["reasoning_end_token_ids", "reasoning_start_token_ids"])
def test_bad_markers_are_refused_by_name(field):
    with pytest.raises(InvalidInputError, match=field):
        Constraint(json=SCHEMA, **{"reasoning_end_token_ids": [1], field: [-1]})
    with pytest.raises(InvalidInputError, match="structured_outputs"):
        SamplingParams(structured_outputs=Constraint(json=SCHEMA, reasoning_end_token_ids=[10**9])) \
            .validate_token_ids(1000)
