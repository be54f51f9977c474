import pytest

from stepahead.errors import StepaheadError
from stepahead.sampling_params import SamplingParams, StructuredOutputsParams
from stepahead.validation import InvalidInputError


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_out_of_range_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidInputError, match=field) as raised:
        SamplingParams(**kwargs)
    # Catchable as stepahead's own error and as the ValueError callers caught before; the field travels along.
    assert isinstance(raised.value, StepaheadError) and isinstance(raised.value, ValueError)
    assert raised.value.param == field


@pytest.mark.parametrize("fields", [{}, {"regex": "a+", "choice": ["a"]}])
def test_structured_outputs_need_exactly_one_constraint(fields):
    with pytest.raises(InvalidInputError, match="exactly one of") as raised:
        StructuredOutputsParams(**fields)
    assert raised.value.param == "structured_outputs"


def test_normalizes_stop_and_top_k():
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop == ["###"] and p.top_k == 0 and p.stop_token_ids == []


def test_stop_token_ids_checked_against_vocab():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[5, 999]).validate_token_ids(100)


def test_logit_bias_keys_become_ints_and_values_are_bounded():
    assert SamplingParams(logit_bias={"5": 100, 7: -2.5}).logit_bias == {5: 100.0, 7: -2.5}
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bias in ({"x": 1.0}, {-1: 1.0}, {True: 1.0}, {5: 100.5}, {5: float("nan")}, {5: "1"}):
        with pytest.raises(InvalidInputError, match="logit_bias") as raised:
            SamplingParams(logit_bias=bias)
        assert raised.value.param == "logit_bias"


def test_token_id_fields_checked_against_vocab():
    for field, value in (("logit_bias", {99: 1.0, 100: 1.0}), ("allowed_token_ids", [3, 100])):
        with pytest.raises(InvalidInputError, match=rf"{field} must be token ids in \[0, 100\), got \[100\]"):
            SamplingParams(**{field: value}).validate_token_ids(100)
    with pytest.raises(InvalidInputError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
