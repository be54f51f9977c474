"""The grammar manager with the built-in model's real tokenizer: compiles off the scheduler's path,
shares equal compiles, and its bitmask allows exactly what the matcher accepts."""

from __future__ import annotations

import threading

from stepahead.config import CacheConfig, SchedulerConfig
from stepahead.core.scheduler import Scheduler
from stepahead.request import Request, RequestStatus
from stepahead.sampling_params import SamplingParams
from stepahead.sampling_params import StructuredOutputsParams as Constraint


def _request(rid: str, constraint: Constraint | None = None) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=8, structured_outputs=constraint), eos_token_id=2)


def _allowed(bitmask_row, vocab_size: int) -> set[int]:
    return {t for t in range(vocab_size) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


def test_a_compiling_grammar_waits_without_blocking_others(manager):
    sched = Scheduler(SchedulerConfig(max_model_len=64, debug_invariants=True), CacheConfig(num_blocks=32))
    sched.structured_output_manager = manager
    hold = threading.Event()
    manager._pool.submit(hold.wait)  # the compile thread is busy: the grammar below waits behind it
    sched.add_request(_request("g", Constraint(regex="[a-z]+")))
    sched.add_request(_request("p"))
    assert sched.requests["g"].status == RequestStatus.WAITING_FOR_GRAMMAR
    assert set(sched.schedule().num_scheduled_tokens) == {"p"}
    hold.set()
    sched.requests["g"].structured_output.compiled.result(timeout=60)
    assert "g" in sched.schedule().num_scheduled_tokens
    assert sched.requests["g"].status == RequestStatus.RUNNING


def test_equal_specs_share_one_compile(manager):
    requests = [_request(f"r{i}", Constraint(json={"type": "object"})) for i in range(3)]
    requests.append(_request("c", Constraint(choice=["a", "b"])))
    for r in requests:
        manager.submit(r)
    assert manager.num_compiles == 2
    assert requests[0].structured_output.compiled is requests[2].structured_output.compiled
    assert requests[0].structured_output.matcher is None  # matchers are per request, made on first use


def test_bitmask_allows_what_the_matcher_accepts(manager, tokenizer, model_config):
    vocab = model_config.vocab_size
    cat_dog, digits = _request("a", Constraint(regex="(cat|dog)s?")), _request("b", Constraint(regex="[0-9]{2}"))
    for r in (cat_dog, digits):
        manager.submit(r)
        r.structured_output.compiled.result(timeout=60)
    first, failed = manager.grammar_bitmask([cat_dog, digits])
    assert not failed
    assert first.shape == (2, (vocab + 31) // 32)
    texts = {t: tokenizer.decode([t]) for t in _allowed(first[0], vocab)}
    assert texts and all("cats".startswith(s) or "dogs".startswith(s) for s in texts.values()), texts
    assert all(s.isdigit() for s in (tokenizer.decode([t]) for t in _allowed(first[1], vocab)))
    assert manager.accept_tokens(cat_dog, tokenizer.encode("cat", add_special_tokens=False))
    after = _allowed(manager.grammar_bitmask([cat_dog])[0][0], vocab)
    assert 2 in after and tokenizer.encode("s", add_special_tokens=False)[0] in after  # end, or the plural
    assert not manager.accept_tokens(digits, tokenizer.encode("x", add_special_tokens=False))
    assert manager.accept_tokens(cat_dog, [2]) and manager.is_terminated(cat_dog)


def test_compile_error_is_reported(manager):
    bad = _request("bad", Constraint(grammar="root ::= undefined_rule"))
    manager.submit(bad)
    bad.structured_output.compiled.exception(timeout=60)
    assert manager.is_ready(bad) and "undefined_rule" in manager.compile_error(bad)


def test_draft_rows_mask_each_position_as_plain_decoding_would(manager, tokenizer):
    """A step's drafts: row j is the bitmask after the output and the first j drafts, exactly the row
    plain decoding gets once those tokens are output; an ungrammatical draft ends the rows followed,
    and the matcher is left as it was."""
    constraint = Constraint(json={"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    request = _request("g", constraint)
    manager.submit(request)
    request.structured_output.compiled.result(timeout=60)
    text = tokenizer.encode('{"name": "Ada"}', add_special_tokens=False)
    assert manager.accept_tokens(request, text[:2])
    drafts = text[2:] + tokenizer.encode("x", add_special_tokens=False)[:1]  # nothing may follow the object
    bitmask, followed, failed = manager.draft_bitmask([request], [drafts])
    assert not failed and followed == [text[2:]] and bitmask.shape[0] == len(text) - 1
    assert manager.grammatical_prefix(request, drafts) == len(text) - 2
    for j in range(len(text) - 1):  # a fresh request output up to that position
        plain = _request(f"p{j}", constraint)
        manager.submit(plain)
        assert manager.accept_tokens(plain, text[:2 + j])
        (row,), _ = manager.grammar_bitmask([plain])
        assert (bitmask[j] == row).all()
    (row,), _ = manager.grammar_bitmask([request])
    assert (row == bitmask[0]).all()  # rolled back
    assert manager.accept_tokens(request, text[2:])


def test_a_draft_that_ends_the_grammar_is_left_to_the_sample(manager, model_config, tokenizer):
    request = _request("c", Constraint(choice=["yes", "no"]))
    manager.submit(request)
    request.structured_output.compiled.result(timeout=60)
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert manager.grammatical_prefix(request, yes) == len(yes)
    assert manager.grammatical_prefix(request, yes + [model_config.eos_token_id]) == len(yes)


def test_drafts_are_followed_through_the_reasoning_into_the_grammar(manager, tokenizer):
    """While the grammar waits for the reasoning to end, every token is allowed: a request's drafts are
    followed with all-allowed rows through the one that ends the reasoning, and the row after that one
    is the grammar's first; the drafts after it are left to the next step. The gate is left as it was."""
    end = tokenizer.encode("</think>", add_special_tokens=False)
    request = _request("r", Constraint(regex="[a-z]+", reasoning_end_token_ids=end))
    manager.submit(request)
    request.structured_output.compiled.result(timeout=60)
    thought = tokenizer.encode("hmm ok", add_special_tokens=False)
    answer = tokenizer.encode("yes", add_special_tokens=False)
    drafts = thought + end + answer
    assert manager.grammatical_prefix(request, drafts) == len(thought) + len(end)
    assert manager.grammatical_prefix(request, thought) == len(thought)  # none ends it: all followed
    bitmask, followed, failed = manager.draft_bitmask([request], [drafts])
    assert not failed and followed == [thought + end] and bitmask.shape[0] == 1 + len(thought) + len(end)
    (gate_row,), _ = manager.grammar_bitmask([request])
    assert (bitmask[0] == gate_row).all() and (bitmask[1:-1] == -1).all()
    grammar = _request("g", Constraint(regex="[a-z]+"))  # the same grammar without a gate, from its start
    manager.submit(grammar)
    grammar.structured_output.compiled.result(timeout=60)
    (first,), _ = manager.grammar_bitmask([grammar])
    assert (bitmask[-1] == first).all() and not (first == -1).all()
    (row,), _ = manager.grammar_bitmask([request])
    assert (row == gate_row).all()  # the gate did not move
    assert manager.accept_tokens(request, thought + end + answer)  # and reads the output as before
