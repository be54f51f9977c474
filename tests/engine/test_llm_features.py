"""LLM features on a shared tiny model: n > 1, stop strings and token ids, prompt forms, order, chat."""

from __future__ import annotations

import pytest

from stepahead import SamplingParams

MAX_MODEL_LEN = 256  # of the module's `llm` (tests/engine/conftest.py)
PROMPT = "def main(argv):\n    parser = "
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_out(llm):
    (out,) = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    return out.outputs[0]


def test_text_prompt_and_token_prompt_agree(llm, greedy_out):
    ids = llm.get_tokenizer().encode(PROMPT)
    outs = llm.generate([PROMPT, {"prompt_token_ids": ids}, ids], GREEDY, use_tqdm=False)
    assert outs[0].prompt == PROMPT and outs[1].prompt is None
    assert all(o.prompt_token_ids == ids for o in outs)
    assert all(o.outputs[0].token_ids == greedy_out.token_ids for o in outs)
    assert greedy_out.text == llm.get_tokenizer().decode(greedy_out.token_ids)


def test_input_order_preserved(llm):
    prompts = [[7] * 90, [8] * 3, [9] * 40, [10] * 1]
    params = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in (2, 9, 5, 1)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 9, 5, 1]


def test_n_completions(llm):
    params = SamplingParams(n=3, max_tokens=8, temperature=0.8, seed=5)
    (a,) = llm.generate(PROMPT, params, use_tqdm=False)
    (b,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in a.outputs] == [0, 1, 2] and a.finished
    samples = [tuple(c.token_ids) for c in a.outputs]
    assert len(set(samples)) == 3  # distinct derived seeds
    assert samples == [tuple(c.token_ids) for c in b.outputs]  # and reproducible
    (g,) = llm.generate(PROMPT, SamplingParams(n=2, max_tokens=8, temperature=0.0), use_tqdm=False)
    assert g.outputs[0].token_ids == g.outputs[1].token_ids


def test_sampling_params_change_the_output(llm, greedy_out):
    outs = llm.generate([PROMPT] * 3, [SamplingParams(max_tokens=16, temperature=0.8, seed=s) for s in (1, 1, 2)],
                        use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    assert toks[0] == toks[1] and toks[0] != toks[2] and toks[0] != greedy_out.token_ids
    (k1,) = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.8, seed=1, top_k=1), use_tqdm=False)
    assert k1.outputs[0].token_ids == greedy_out.token_ids  # top_k=1 is greedy


@pytest.mark.parametrize("include", [False, True])
def test_stop_string(llm, greedy_out, include):
    text = greedy_out.text
    k = len(text) // 2
    stop = text[k:k + 3]
    k = text.find(stop)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=["\x00never", stop],
                            include_stop_str_in_output=include)
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == (text[:k + 3] if include else text[:k])
    assert c.token_ids == greedy_out.token_ids[:len(c.token_ids)]
    assert len(c.token_ids) < len(greedy_out.token_ids)
    assert not llm.engine_core.has_work()  # the engine was told to abort it


def test_stop_token_ids(llm, greedy_out):
    toks = greedy_out.token_ids
    i = next(i for i in range(3, len(toks)) if toks[i] not in toks[:i])
    params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[toks[i]])
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == toks[:i + 1]
    assert c.finish_reason == "stop" and c.stop_reason == toks[i]
    assert c.text == llm.get_tokenizer().decode(toks[:i])


def test_logprobs(llm, greedy_out):
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3),
                          use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == greedy_out.token_ids[:4] and len(c.logprobs) == 4
    for tok, d in zip(c.token_ids, c.logprobs, strict=True):
        assert d[tok].rank == 1 and len(d) == 3 and all(lp.logprob <= 0 for lp in d.values())


def test_chat(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "hello there"}]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (out,) = llm.chat(conv, params, use_tqdm=False)
    assert out.prompt == "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)
    (ref,) = llm.generate({"prompt_token_ids": out.prompt_token_ids}, params, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    two = llm.chat([conv, conv + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "bye"}]],
                   params, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == ref.outputs[0].token_ids
    assert two[1].prompt.endswith("<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n")
    (no_gen,) = llm.chat(conv, params, use_tqdm=False, add_generation_prompt=False)
    assert not no_gen.prompt.endswith("assistant\n")


def test_stream_yields_deltas_that_add_up(llm, greedy_out):
    deltas = list(llm.generate_stream(PROMPT, GREEDY))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert [t for d in deltas for t in d.outputs[0].token_ids] == greedy_out.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == greedy_out.text


def test_progress_bar(llm, capsys):
    llm.generate([PROMPT, PROMPT], SamplingParams(max_tokens=2), use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


@pytest.mark.parametrize("span", [(1, 2), (3, 5)])
def test_bad_words_are_never_completed(llm, greedy_out, span):
    """vLLM's bad_words: the greedy output's own words (one token, then two) never appear again."""
    tokens = greedy_out.token_ids
    word = llm.get_tokenizer().decode(tokens[span[0]:span[1]])
    words = llm.input_processor.bad_words_token_ids([word])
    assert any(_contains(tokens, ids) for ids in words)
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, bad_words=[word]),
                          use_tqdm=False)
    banned = out.outputs[0].token_ids
    assert not any(_contains(banned, ids) for ids in words)
    first = next(i for i in range(len(tokens)) if any(_contains(tokens[:i + 1], ids) for ids in words))
    assert banned[:first] == tokens[:first] and banned != tokens  # the same output up to the banned token


def test_bad_words_must_be_words():
    with pytest.raises(ValueError, match="bad_words must be non-empty strings"):
        SamplingParams(bad_words=["ok", " "])
