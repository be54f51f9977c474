"""OutputProcessor on the real tiny tokenizer, fed EngineCoreOutputs as the engine core emits them."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from stepahead.core.sched_output import EngineCoreOutput, TokenLogprobs
from stepahead.engine.output_processor import OutputProcessor, RequestOutputKind
from stepahead.request import Request
from stepahead.sampling_params import SamplingParams

EOS = 2
TEXT = "def héllo(wörld):\n    return '日本語 😀' + x  # done"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def _reqs(request_id, params, prompt_ids=(10, 11, 12)):
    n = params.n
    return [Request(f"{i}_{request_id}", list(prompt_ids), params, eos_token_id=EOS) for i in range(n)]


def _add(proc, request_id, kind=RequestOutputKind.CUMULATIVE, prompt_ids=(10, 11, 12), **params):
    reqs = _reqs(request_id, SamplingParams(**params), prompt_ids)
    proc.add_request(request_id, reqs, "prompt", kind)
    return [r.request_id for r in reqs]


def _feed_one_by_one(proc, engine_id, ids, last_finish=None, stop_reason=None):
    outs = []
    for k, tid in enumerate(ids):
        fin = last_finish if k == len(ids) - 1 else None
        ros, aborts = proc.process_outputs([EngineCoreOutput(engine_id, [tid], fin, stop_reason if fin else None)])
        outs.append((ros, aborts))
    return outs


def test_incremental_detokenization_matches_full_decode(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in ids)  # some characters span tokens
    proc = OutputProcessor(tokenizer)
    (eid,) = _add(proc, "a", RequestOutputKind.DELTA, max_tokens=len(ids))
    steps = _feed_one_by_one(proc, eid, ids, last_finish="length")
    deltas = [ro.outputs[0].text for ros, _ in steps for ro in ros]
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    final = steps[-1][0][0]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert not proc.has_unfinished_requests()


def test_cumulative_and_final_only(tokenizer):
    ids = tokenizer.encode(TEXT)
    proc = OutputProcessor(tokenizer)
    (cum,) = _add(proc, "c", RequestOutputKind.CUMULATIVE)
    (fin,) = _add(proc, "f", RequestOutputKind.FINAL_ONLY)
    seen_final = []
    for k, tid in enumerate(ids):
        last = k == len(ids) - 1
        ros, _ = proc.process_outputs([EngineCoreOutput(cum, [tid], "length" if last else None),
                                       EngineCoreOutput(fin, [tid], "length" if last else None)])
        by_id = {ro.request_id: ro for ro in ros}
        assert by_id["c"].outputs[0].token_ids == ids[:k + 1]
        assert TEXT.startswith(by_id["c"].outputs[0].text)
        if "f" in by_id:
            seen_final.append(by_id["f"])
    assert len(seen_final) == 1 and seen_final[0].outputs[0].text == TEXT
    assert seen_final[0].outputs[0].token_ids == ids
    assert seen_final[0].prompt == "prompt" and seen_final[0].prompt_token_ids == [10, 11, 12]


def test_eos_not_in_text_but_in_token_ids(tokenizer):
    ids = tokenizer.encode("hello world")
    for skip in (True, False):
        proc = OutputProcessor(tokenizer)
        (eid,) = _add(proc, "e", RequestOutputKind.FINAL_ONLY, skip_special_tokens=skip)
        ros, aborts = proc.process_outputs([EngineCoreOutput(eid, ids + [EOS], "stop", None)])
        out = ros[0].outputs[0]
        assert out.text == "hello world" and out.token_ids == ids + [EOS]
        assert out.finish_reason == "stop" and out.stop_reason is None and aborts == []


def test_skip_special_tokens(tokenizer):
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = tokenizer.encode("ab") + [im_start] + tokenizer.encode("cd")
    texts = {}
    for skip in (True, False):
        proc = OutputProcessor(tokenizer)
        (eid,) = _add(proc, "s", RequestOutputKind.FINAL_ONLY, skip_special_tokens=skip)
        _feed_one_by_one(proc, eid, ids[:-1])
        ros, _ = proc.process_outputs([EngineCoreOutput(eid, ids[-1:], "length")])
        texts[skip] = ros[0].outputs[0].text
    assert texts == {True: "abcd", False: "ab<|im_start|>cd"}


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_and_aborts(tokenizer, include):
    ids = tokenizer.encode("x = 1\nreturn value\nmore text after")
    proc = OutputProcessor(tokenizer)
    (eid,) = _add(proc, "s", RequestOutputKind.DELTA, stop=["value", "never"], include_stop_str_in_output=include)
    streamed, finals, aborts = "", [], []
    for tid in ids:
        ros, ab = proc.process_outputs([EngineCoreOutput(eid, [tid])])
        aborts += ab
        for ro in ros:
            streamed += ro.outputs[0].text
            if ro.finished:
                finals.append(ro.outputs[0])
    expected = "x = 1\nreturn value" if include else "x = 1\nreturn "
    assert streamed == expected  # held-back text never had to be taken back
    assert len(finals) == 1 and finals[0].finish_reason == "stop" and finals[0].stop_reason == "value"
    assert aborts == [eid]  # the engine still runs it: the frontend asks for the abort, once
    assert not proc.has_unfinished_requests()


def test_stop_string_on_engine_finished_step_needs_no_abort(tokenizer):
    ids = tokenizer.encode("return value")
    proc = OutputProcessor(tokenizer)
    (eid,) = _add(proc, "s", RequestOutputKind.FINAL_ONLY, stop=["value"])
    ros, aborts = proc.process_outputs([EngineCoreOutput(eid, ids, "length")])
    assert aborts == [] and ros[0].outputs[0].text == "return " and ros[0].outputs[0].stop_reason == "value"


def test_stop_token_id_reason_kept(tokenizer):
    ids = tokenizer.encode("ab")
    proc = OutputProcessor(tokenizer)
    (eid,) = _add(proc, "t", RequestOutputKind.FINAL_ONLY, stop_token_ids=[ids[-1]])
    ros, _ = proc.process_outputs([EngineCoreOutput(eid, ids, "stop", ids[-1])])
    out = ros[0].outputs[0]
    assert out.stop_reason == ids[-1] and out.token_ids == ids and out.text == tokenizer.decode(ids[:-1])


def test_logprobs_become_dicts(tokenizer):
    proc = OutputProcessor(tokenizer)
    (eid,) = _add(proc, "l", RequestOutputKind.DELTA, logprobs=2)
    lp1 = TokenLogprobs(token_ids=[40, 40, 41], logprobs=[-0.1, -0.1, -2.0], sampled_rank=1)
    lp2 = TokenLogprobs(token_ids=[50, 51, 52], logprobs=[-3.0, -0.5, -1.0], sampled_rank=7)
    ros, _ = proc.process_outputs([EngineCoreOutput(eid, [40], new_logprobs=[lp1])])
    (d1,) = ros[0].outputs[0].logprobs
    assert set(d1) == {40, 41} and d1[40].rank == 1 and d1[41].rank == 2 and d1[41].logprob == -2.0
    assert d1[40].decoded_token == tokenizer.decode([40])
    ros, _ = proc.process_outputs([EngineCoreOutput(eid, [50], "length", new_logprobs=[lp2])])
    (d2,) = ros[0].outputs[0].logprobs  # DELTA: only the new token's entry
    assert d2[50].rank == 7 and d2[50].logprob == -3.0 and d2[51].rank == 1 and d2[52].rank == 2


def test_n_children_aggregate(tokenizer):
    proc = OutputProcessor(tokenizer)
    e0, e1 = _add(proc, "p", RequestOutputKind.DELTA, n=2)
    a, b = tokenizer.encode("ab"), tokenizer.encode("cd")
    ros, _ = proc.process_outputs([EngineCoreOutput(e1, b, "length")])
    assert len(ros) == 1 and not ros[0].finished
    assert [(c.index, c.text, c.finish_reason) for c in ros[0].outputs] == [(1, "cd", "length")]
    ros, _ = proc.process_outputs([EngineCoreOutput(e1, [7]), EngineCoreOutput(e0, a, "length")])
    assert ros[0].finished and [c.index for c in ros[0].outputs] == [0]  # outputs of a finished child ignored
    assert not proc.has_unfinished_requests()

    e0, e1 = _add(proc, "q", RequestOutputKind.CUMULATIVE, n=2)
    ros, _ = proc.process_outputs([EngineCoreOutput(e0, a)])
    assert [(c.index, c.text) for c in ros[0].outputs] == [(0, "ab"), (1, "")]


def test_unknown_and_aborted_requests_ignored(tokenizer):
    proc = OutputProcessor(tokenizer)
    e0, e1 = _add(proc, "p", RequestOutputKind.CUMULATIVE, n=2)
    proc.process_outputs([EngineCoreOutput(e0, [5], "length")])
    assert proc.abort_request("p") == [e1]
    assert proc.abort_request("p") == []
    ros, aborts = proc.process_outputs([EngineCoreOutput(e1, [5]), EngineCoreOutput("nope", [5])])
    assert ros == [] and aborts == [] and not proc.has_unfinished_requests()


def test_duplicate_request_id_rejected(tokenizer):
    proc = OutputProcessor(tokenizer)
    _add(proc, "d")
    with pytest.raises(ValueError, match="already in use"):
        _add(proc, "d")


@pytest.mark.parametrize("seed", range(5))
def test_random_byte_tokens_stream_to_the_full_decode(tokenizer, seed):
    """Random ids (random models emit them) split and garble UTF-8; the streamed text still equals decode()."""
    import random

    rng = random.Random(seed)
    ids = [rng.randrange(3, len(tokenizer)) for _ in range(40)]  # no special tokens
    proc = OutputProcessor(tokenizer)
    (eid,) = _add(proc, "r", RequestOutputKind.DELTA, prompt_ids=tokenizer.encode("x = 1\n"))
    steps = _feed_one_by_one(proc, eid, ids, last_finish="length")
    assert "".join(ro.outputs[0].text for ros, _ in steps for ro in ros) == tokenizer.decode(ids)


def test_incomplete_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer.encode("ab") + tokenizer.encode("日")[:1]
    assert tokenizer.decode(ids).endswith("\ufffd")
    proc = OutputProcessor(tokenizer)
    (eid,) = _add(proc, "f", RequestOutputKind.FINAL_ONLY)
    ros, _ = proc.process_outputs([EngineCoreOutput(eid, ids, "length")])
    assert ros[0].outputs[0].text == tokenizer.decode(ids)


def test_spaces_between_special_tokens():
    """A WordPiece decoder puts a space between two special tokens; spaces_between_special_tokens false
    joins a special token to the special token before it (vLLM's), and leaves every other space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    backend.train_from_iterator(["hello world"] * 20, trainers.WordPieceTrainer(
        vocab_size=100, special_tokens=["[UNK]", "[A]", "[B]"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, additional_special_tokens=["[A]", "[B]"])
    a, b = tokenizer.convert_tokens_to_ids(["[A]", "[B]"])
    output = [a, b, *tokenizer.encode("hello world", add_special_tokens=False), a]

    def text(spaces: bool) -> str:
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(max_tokens=8, skip_special_tokens=False, spaces_between_special_tokens=spaces)
        prompt = tokenizer.encode("hello", add_special_tokens=False)
        processor.add_request("r", [Request("r", prompt, params)], None, RequestOutputKind.FINAL_ONLY)
        for i, token in enumerate(output):  # one token a step, as decoding delivers them
            last = i == len(output) - 1
            outs, _ = processor.process_outputs([EngineCoreOutput("r", [token], "length" if last else None)])
        return outs[0].outputs[0].text

    assert text(True) == " [A] [B] hello world [A]"
    assert text(False) == " [A][B] hello world [A]"
