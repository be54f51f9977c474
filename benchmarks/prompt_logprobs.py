"""What prompt logprobs cost a prefill: the built-in model, 8 prompts of 256 random tokens, max_tokens 1,
prefix caching off (every run computes every position), uni executor; medians of 5 runs per setting
after one warm-up, the settings in the order given.

    python benchmarks/prompt_logprobs.py [--order none,0,5,20]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from stepahead import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--order", default="none,0,5,20", help="prompt_logprobs settings, 'none' for off")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(256)]} for _ in range(8)]
    with LLM(executor="uni", enable_prefix_caching=False) as llm:
        for setting in args.order.split(","):
            k = None if setting == "none" else int(setting)
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
            llm.generate(prompts, params, use_tqdm=False)
            times = []
            for _ in range(5):
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times.append(time.perf_counter() - start)
            print(f"prompt_logprobs={k}: median {statistics.median(times):.3f} s, min {min(times):.3f} s")


if __name__ == "__main__":
    main()
