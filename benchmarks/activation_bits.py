"""What 8-bit activation codes would cost the packed model, emulated: greedy and logit agreement with fp32.

The packed 4-bit kernel (kernels/packed_gemm.cpp) quantizes each activation, rounded to bfloat16, to
a 16-bit integer per group of 32. 8-bit codes (llama.cpp's Q4 x Q8) would let `vpmaddubsw` multiply
twice as many pairs per instruction on AVX2. This script replaces the kernel in the 4-bit
projections with the same arithmetic in float64 (activations rounded to bfloat16, quantized per
group of 32 to `--bits` bits, times the dequantized weight, the sum rounded to bfloat16) and
compares the built-in model with the dequantized fp32 model on N chat prompts: greedy token
agreement over T tokens, and teacher-forced logits on the fp32 model's continuation.

    .venv/bin/python benchmarks/activation_bits.py --bits 16     # the kernel's arithmetic, emulated
    .venv/bin/python benchmarks/activation_bits.py --bits 8
    .venv/bin/python benchmarks/activation_bits.py --kernel      # the kernel itself
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from quant_quality import prompts

from stepahead.bench.full_forward import greedy_tokens, sequence_logits
from stepahead.models.loading.loader import load_model, load_model_config, load_tokenizer
from stepahead.models.quant.quantized_linear import Int4Linear


def quantized_activations(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [rows, K] as the kernel would see it with `bits`-bit codes per group of 32 (dequantized)."""
    groups = x.to(torch.bfloat16).double().view(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    step = amax / (2 ** (bits - 1) - 1)
    codes = torch.round(groups / torch.where(amax > 0, step, torch.ones_like(step)))
    return (codes * step).view(x.shape)


def emulate(bits: int) -> None:
    """Every 4-bit projection from now on computes with `bits`-bit activation codes, in float64."""
    def packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "_dequantized"):
            self._dequantized = self.dequantized_weight().double()
        y = F.linear(quantized_activations(flat.float(), bits), self._dequantized)
        return y.to(torch.bfloat16).float()
    Int4Linear._packed_mm = packed_mm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, default=8, help="activation code bits to emulate")
    parser.add_argument("--kernel", action="store_true", help="run the kernel itself instead")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=24)
    ns = parser.parse_args()
    if not ns.kernel:
        emulate(ns.bits)
    reference = load_model(load_model_config(None, "cpu", quantization="none", dtype="float32"), "cpu")
    config = load_model_config(None, "cpu", quantization="gguf")
    model, tokenizer = load_model(config, "cpu"), load_tokenizer(config)
    started = time.perf_counter()
    equal = identical = 0
    diff_sum = diff_max = 0.0
    logits = argmax_equal = positions = 0
    for chat in prompts(ns.num_prompts):
        prompt = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])
        ref, got = greedy_tokens(reference, prompt, ns.max_tokens), greedy_tokens(model, prompt, ns.max_tokens)
        equal += sum(a == b for a, b in zip(ref, got, strict=True))
        identical += ref == got
        start = len(prompt) - 1  # rows predicting the continuation
        a = sequence_logits(model, prompt + ref)[start:-1]
        b = sequence_logits(reference, prompt + ref)[start:-1]
        diff = (a - b).abs()
        diff_sum, diff_max, logits = diff_sum + float(diff.sum()), max(diff_max, float(diff.max())), logits + diff.numel()
        argmax_equal += int((a.argmax(-1) == b.argmax(-1)).sum())
        positions += a.shape[0]
    label = "the kernel" if ns.kernel else f"{ns.bits}-bit codes, emulated"
    print(f"{label}: greedy token agreement {equal / (ns.num_prompts * ns.max_tokens):.3f}, identical outputs "
          f"{identical}/{ns.num_prompts}, mean |dlogit| {diff_sum / logits:.4f}, max {diff_max:.3f}, "
          f"teacher-forced argmax agreement {argmax_equal / positions:.4f} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
