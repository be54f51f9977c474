"""logit_bias and allowed_token_ids through the offline LLM (engine, worker and back)."""

from __future__ import annotations

import pytest

from stepahead import SamplingParams
from stepahead.validation import InvalidInputError

MAX_MODEL_LEN = 128  # of the module's `llm` (tests/engine/conftest.py)
PROMPT = "def main(argv):\n    parser = "


def _greedy(llm, **params) -> list[int]:
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, **params),
                          use_tqdm=False)
    return out.outputs[0].token_ids


def test_logit_bias_forces_and_bans_tokens(llm):
    plain = _greedy(llm)
    forced = 5 if plain[0] != 5 else 6
    assert _greedy(llm, logit_bias={forced: 100.0}) == [forced] * 6
    banned = _greedy(llm, logit_bias={plain[0]: -100.0})
    assert plain[0] not in banned and banned != plain


def test_allowed_token_ids_restrict_the_output(llm):
    plain = _greedy(llm)
    allowed = [t for t in range(10, 14) if t not in plain]
    assert set(_greedy(llm, allowed_token_ids=allowed)) <= set(allowed)


@pytest.mark.parametrize("field, value", [("logit_bias", {10**6: 1.0}), ("allowed_token_ids", [10**6])])
def test_token_ids_outside_the_vocabulary_are_refused(llm, field, value):
    with pytest.raises(InvalidInputError, match=f"{field} must be token ids in") as raised:
        llm.generate(PROMPT, SamplingParams(**{field: value}), use_tqdm=False)
    assert raised.value.param == field
