"""Gemma 2 and Gemma 3 text models: greedy ids equal transformers' float32 on tiny random checkpoints
(a windowed and a global layer, the window shorter than prompt + output, logit caps that bite), on
stepahead's attention kernel and on SDPA, chunked and from the prefix cache; the final logit cap in
the logprobs; the multimodal checkpoint refused by name."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest
import torch

from stepahead import LLM, SamplingParams
from stepahead.models.loading.loader import load_model_config
from stepahead.models.rope import rope_type
from tests.tiny_models import GEMMA_ARCHS, hf_greedy

MAX_TOKENS = 20
PROMPT_LENS = (3, 17, 40, 66)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in PROMPT_LENS]


def _generate(folder, prompts, params=None, **engine):
    params = params or SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(folder), executor="uni", **engine) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_greedy_matches_transformers(tiny_model_factory, arch, attention_path):
    folder = tiny_model_factory(arch)
    config = load_model_config(str(folder), "cpu")
    assert config.sliding_windows == (8, None) and config.max_model_len == 512
    prompts = _prompts()
    expected = hf_greedy(folder, prompts, MAX_TOKENS)
    outs = _generate(folder, prompts, block_size=16)
    assert [o.outputs[0].token_ids for o in outs] == expected
    chunked = _generate(folder, prompts, block_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    assert [o.outputs[0].token_ids for o in chunked] == expected


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_a_prefix_cache_hit_equals_the_plain_run(tiny_model_factory, arch):
    folder = tiny_model_factory(arch)
    base = _prompts()[3]
    longer = base[:48] + [7, 8, 9]
    plain = _generate(folder, [longer], block_size=16, enable_prefix_caching=False)[0].outputs[0].token_ids
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(folder), executor="uni", block_size=16) as llm:
        llm.generate([{"prompt_token_ids": base}], params, use_tqdm=False)
        hit = llm.generate([{"prompt_token_ids": longer}], params, use_tqdm=False)
        assert llm.stats().prefix_cache_hits > 0
    assert hit[0].outputs[0].token_ids == plain


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_logprobs_hold_the_final_logit_cap(tiny_model_factory, arch):
    """Greedy ids cannot see the final cap (tanh keeps the order); the logprobs can: they equal the
    log-softmax of transformers' capped logits."""
    import transformers

    folder = tiny_model_factory(arch)
    prompt = _prompts()[2]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    out = _generate(folder, [prompt], params, block_size=16)[0].outputs[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1)
    got = torch.tensor([entry[token].logprob for entry, token in zip(out.logprobs, out.token_ids, strict=True)])
    assert float(logits.abs().max()) <= model.config.final_logit_softcapping
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_the_multimodal_gemma3_is_refused_by_name(tiny_model_factory, tmp_path):
    folder = shutil.copytree(tiny_model_factory("gemma3"), tmp_path / "gemma3-mm")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["Gemma3ForConditionalGeneration"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration.*multimodal"):
        load_model_config(str(folder), "cpu")


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_gguf_as_llama_cpp_writes_it_matches_transformers(tiny_model_factory, tmp_path, arch):
    """llama.cpp's converter stores the norm weights as 1 + w, names the norms its own way and writes
    the window, the caps and (Gemma 3) the rope bases as metadata: loaded back, the weights are the
    checkpoint's and the greedy ids transformers'."""
    from stepahead.models.loading.loader import load_model
    from tests.models.gguf_writer import write_gguf

    folder = tiny_model_factory(arch)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(folder, path, arch=arch)
    g_cfg, s_cfg = load_model_config(str(path), "cpu"), load_model_config(str(folder), "cpu")
    assert g_cfg.architecture == s_cfg.architecture and g_cfg.sliding_windows == s_cfg.sliding_windows
    g, s = load_model(g_cfg, "cpu"), load_model(s_cfg, "cpu")
    # the file holds eps as float32, and a default rope as no scaling at all
    same = ("rms_norm_eps", "rope_scaling")
    assert g.args.rms_norm_eps == pytest.approx(s.args.rms_norm_eps, rel=1e-6)
    assert rope_type(g.args.rope_scaling) == rope_type(s.args.rope_scaling)
    assert g.args.rope_scaling is None or g.args.rope_scaling.get("factor") == s.args.rope_scaling.get("factor")
    assert dataclasses.replace(g.args, **{f: None for f in same}) == dataclasses.replace(s.args, **{f: None for f in same})
    for (name, a), (_, b) in zip(g.named_parameters(), s.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=name)
    prompts = _prompts()
    outs = _generate(path, prompts, tokenizer=str(folder), block_size=16)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(folder, prompts, MAX_TOKENS)
