"""On the built-in model's packed weights how a prompt is scheduled never changes a bit of its output:
every token, a prompt's or a generated one, attends through the decode kernel at its own position, and
the packed projections compute each row on its own. So a prompt prefilled in chunks, behind a
prefix-cache hit, or again after a preemption gives exactly the logprobs of one plain prefill."""

from __future__ import annotations

import pytest

from stepahead import LLM, SamplingParams

QUESTIONS = ["What is the capital of France?", "Write one sentence about the sea.",
             "List three colours, then explain which one you like best and why.", "What is 7 times 8?"]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=4)
KW = dict(executor="uni", max_model_len=128)


def _prompts(llm: LLM) -> list[str]:
    tok = llm.get_tokenizer()
    # a shared system prompt: a prefix the cache can hold across requests
    system = {"role": "system", "content": "You are a concise assistant who answers in plain English."}
    return [tok.apply_chat_template([system, {"role": "user", "content": q}], tokenize=False,
                                    add_generation_prompt=True) for q in QUESTIONS]


def _outputs(llm: LLM, prompts: list[str]) -> list[tuple[list[int], list[dict[int, float]]]]:
    return [(o.outputs[0].token_ids, [{i: lp.logprob for i, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain():
    """Every prompt prefilled whole in one step, nothing cached, nothing preempted."""
    with LLM(**KW, enable_prefix_caching=False) as llm:
        assert llm.config.model_config.quantization != "none"  # the packed path is what this checks
        prompts = _prompts(llm)
        return prompts, _outputs(llm, prompts)


def test_chunked_prefill_gives_the_same_bits(plain):
    prompts, want = plain
    with LLM(**KW, enable_prefix_caching=False, max_num_batched_tokens=24) as llm:
        assert _outputs(llm, prompts) == want


def test_a_prefix_cache_hit_gives_the_same_bits(plain):
    prompts, want = plain
    with LLM(**KW) as llm:
        _outputs(llm, prompts[:1])  # caches the shared system prompt's blocks
        assert _outputs(llm, prompts) == want
        assert llm.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("is_async", [True, False])
def test_preemption_gives_the_same_bits(plain, is_async):
    prompts, want = plain
    with LLM(**KW, enable_prefix_caching=False, num_kv_blocks=10, async_scheduling=is_async) as llm:
        assert _outputs(llm, prompts) == want
        assert llm.stats().preemptions > 0
