"""Quantized weights against the dequantized float32 model: logits and greedy agreement.

The built-in model (or --model) loaded twice: with --quantization QUANT (default auto: the GGUF
file's Q4_1/Q8_0 tensors kept packed) and with --quantization none --dtype float32 (the reference:
the same quantized values dequantized to fp32). For N chat prompts:

- greedy agreement: both engines generate T tokens greedily; the share of positions where the
  tokens are equal, and the mean number of tokens before the first difference;
- logits: both models score the prompt + the reference continuation in one teacher-forced pass
  (stepahead.bench.full_forward); max and mean absolute difference of the logits over the
  generated positions, and the share of positions whose argmax agrees.

    .venv/bin/python benchmarks/quant_quality.py                   # 64 prompts x 64 tokens
    .venv/bin/python benchmarks/quant_quality.py --quantization int8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from stepahead import LLM, SamplingParams
from stepahead.bench.full_forward import sequence_logits
from stepahead.models.loading.loader import load_model

TOPICS = ["France", "the Moon", "photosynthesis", "the Roman Empire", "Python lists", "rainbows", "volcanoes",
          "the heart", "gravity", "coffee", "the Internet", "penguins", "chess", "the ocean", "music", "bread"]
TEMPLATES = ["What is {}?", "Tell me three facts about {}.", "Explain {} to a child.", "Write a short poem about {}."]


def prompts(n: int) -> list[list[dict]]:
    texts = [t.format(topic) for t in TEMPLATES for topic in TOPICS]
    return [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(n)]


def generate(llm_kwargs: dict, chats: list, max_tokens: int):
    with LLM(max_num_seqs=16, **llm_kwargs) as llm:
        outs = llm.chat(chats, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
        model = load_model(llm.config.model_config, "cpu")
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs], model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    ns = parser.parse_args()
    chats = prompts(ns.num_prompts)
    started = time.perf_counter()
    ref, ref_model = generate(dict(model=ns.model, quantization="none", dtype="float32"), chats, ns.max_tokens)
    got, model = generate(dict(model=ns.model, quantization=ns.quantization), chats, ns.max_tokens)
    equal = total = 0
    prefix = []
    max_diff, sum_diff, n_logits, argmax_equal, n_pos = 0.0, 0.0, 0, 0, 0
    for (prompt, ref_out), (_, out) in zip(ref, got, strict=True):
        equal += sum(a == b for a, b in zip(ref_out, out, strict=True))
        total += len(ref_out)
        prefix.append(next((i for i, (a, b) in enumerate(zip(ref_out, out, strict=True)) if a != b), len(ref_out)))
        seq = prompt + ref_out
        start = len(prompt) - 1  # rows predicting the continuation
        a = sequence_logits(model, seq)[start:-1]
        b = sequence_logits(ref_model, seq)[start:-1]
        diff = (a - b).abs()
        max_diff = max(max_diff, float(diff.max()))
        sum_diff += float(diff.sum())
        n_logits += diff.numel()
        argmax_equal += int((a.argmax(-1) == b.argmax(-1)).sum())
        n_pos += a.shape[0]
    result = {
        "quantization": ns.quantization, "prompts": ns.num_prompts, "tokens": ns.max_tokens,
        "greedy_token_agreement": equal / total,
        "mean_tokens_before_first_difference": sum(prefix) / len(prefix),
        "identical_outputs": sum(p == ns.max_tokens for p in prefix),
        "logits_max_abs_diff": max_diff, "logits_mean_abs_diff": sum_diff / n_logits,
        "teacher_forced_argmax_agreement": argmax_equal / n_pos,
        "reference_logit_abs_mean": float(sequence_logits(ref_model, ref[0][0] + ref[0][1]).abs().mean()),
        "seconds": time.perf_counter() - started,
    }
    print(json.dumps(result, indent=1))
    print("first answer, reference:", repr(_decode(ns.model, ref[0][1])))
    print("first answer, quantized:", repr(_decode(ns.model, got[0][1])))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=1)


def _decode(model, ids):
    from stepahead.models.loading.loader import load_model_config, load_tokenizer

    return load_tokenizer(load_model_config(model, "cpu")).decode(ids)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
