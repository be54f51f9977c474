from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from stepahead.config import ModelConfig
from stepahead.engine.input_processor import InputProcessor
from stepahead.sampling_params import SamplingParams, StructuredOutputsParams
from stepahead.validation import InvalidInputError

MAX_LEN = 64
VOCAB = 2048


@pytest.fixture(scope="module")
def processor(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    config = ModelConfig(model=str(tiny_llama), architecture="LlamaForCausalLM", hf_config={}, dtype="float32",
                         max_model_len=MAX_LEN, vocab_size=VOCAB, num_layers=2, num_kv_heads=2, head_dim=16,
                         eos_token_id=2)
    return InputProcessor(config, tokenizer)


def test_text_prompt_is_tokenized(processor):
    reqs, text = processor.process("r", "def foo(x):", SamplingParams(max_tokens=4))
    assert text == "def foo(x):"
    assert len(reqs) == 1 and reqs[0].request_id == "0_r"
    assert reqs[0].prompt_token_ids == processor.tokenizer.encode("def foo(x):")
    assert reqs[0].eos_token_id == 2


@pytest.mark.parametrize("prompt", [[5, 6, 7], {"prompt_token_ids": [5, 6, 7]}])
def test_token_prompts(processor, prompt):
    reqs, text = processor.process("r", prompt, SamplingParams(max_tokens=4))
    assert text is None
    assert reqs[0].prompt_token_ids == [5, 6, 7]


def test_prompt_dict_may_carry_text(processor):
    _, text = processor.process("r", {"prompt_token_ids": [5, 6], "prompt": "ab"}, SamplingParams(max_tokens=4))
    assert text == "ab"


def test_n_children_have_distinct_reproducible_seeds(processor):
    params = SamplingParams(n=3, seed=7, max_tokens=4, temperature=0.8)
    reqs, _ = processor.process("x", [5, 6], params)
    assert [r.request_id for r in reqs] == ["0_x", "1_x", "2_x"]
    seeds = [r.sampling_params.seed for r in reqs]
    assert seeds[0] == 7 and len(set(seeds)) == 3
    assert all(r.sampling_params.n == 1 for r in reqs)
    again, _ = processor.process("y", [5, 6], params)
    assert [r.sampling_params.seed for r in again] == seeds
    assert params.n == 3 and params.seed == 7  # the caller's params are not modified
    unseeded, _ = processor.process("z", [5, 6], SamplingParams(n=2, max_tokens=4))
    assert [r.sampling_params.seed for r in unseeded] == [None, None]


@pytest.mark.parametrize("prompt", ["", [], {"prompt_token_ids": []}])
def test_empty_prompt_rejected(processor, prompt):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        processor.process("r", prompt, SamplingParams())


@pytest.mark.parametrize("bad", [VOCAB, -1, 10**9])
def test_out_of_vocab_ids_rejected(processor, bad):
    with pytest.raises(ValueError, match=rf"prompt_token_ids must be token ids in \[0, {VOCAB}\)"):
        processor.process("r", [5, bad], SamplingParams())


def test_non_integer_ids_rejected(processor):
    with pytest.raises(ValueError, match="list of integers"):
        processor.process("r", [5, "a"], SamplingParams())
    with pytest.raises(ValueError, match="prompt_token_ids"):
        processor.process("r", {"ids": [5]}, SamplingParams())


def test_too_long_prompt_rejected(processor):
    msg = rf"maximum context length is {MAX_LEN} tokens. However, you requested 70 tokens \(60 in the messages, 10 in"
    with pytest.raises(ValueError, match=msg):
        processor.process("r", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="maximum context length"):
        processor.process("r", [5] * MAX_LEN, SamplingParams(max_tokens=None))
    reqs, _ = processor.process("r", [5] * 54, SamplingParams(max_tokens=10))  # exactly fits
    assert reqs[0].max_tokens == 10
    reqs, _ = processor.process("r", [5] * 60, SamplingParams(max_tokens=None))  # the rest of the context
    assert reqs[0].max_tokens == 4


def test_stop_token_ids_checked_against_vocab(processor):
    with pytest.raises(ValueError, match="stop_token_ids"):
        processor.process("r", [5], SamplingParams(stop_token_ids=[VOCAB + 1]))


@pytest.mark.parametrize("prompt, param", [
    ("", "prompt"), ([5, VOCAB], "prompt_token_ids"), ([5, "a"], "prompt_token_ids"), (3.5, "prompt"),
])
def test_errors_are_typed_and_name_the_field(processor, prompt, param):
    with pytest.raises(InvalidInputError) as raised:
        processor.process("r", prompt, SamplingParams())
    assert raised.value.param == param and isinstance(raised.value, ValueError)


def test_structured_outputs_are_refused_without_a_backend(processor):
    """--structured-outputs-backend none: a constraint is an error, never ignored."""
    none = InputProcessor(processor.model_config, processor.tokenizer, structured_outputs_backend="none")
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(InvalidInputError, match="structured outputs are disabled") as raised:
        none.process("r", [5, 6], params)
    assert raised.value.param == "structured_outputs"
    requests, _ = processor.process("r", [5, 6], params)  # the default backend takes it
    assert requests[0].use_structured_output
