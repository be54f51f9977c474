"""Offline throughput and worker utilization of LLM.generate: async (step-ahead) vs sync scheduling.

Built-in model by default; N requests of random token ids, input and output lengths uniform in the
given ranges from a seed, ignore_eos, all submitted in one generate call. Each mode gets its own
engine and one warm-up request. Prints one line per mode; --json writes the numbers.

    .venv/bin/python benchmarks/offline_throughput.py                      # 64 requests, 32-256 / 32-256
    .venv/bin/python benchmarks/offline_throughput.py --num-threads 2 --modes async
"""

from __future__ import annotations

import argparse
import json
import time

from stepahead import LLM, SamplingParams
from stepahead.bench.datasets import random_token_requests


def run_mode(args: argparse.Namespace, async_scheduling: bool) -> dict:
    llm = LLM(args.model, async_scheduling=async_scheduling, executor=args.executor, num_threads=args.num_threads,
              max_num_seqs=args.max_num_seqs)
    try:
        tok = llm.get_tokenizer()
        reqs = random_token_requests(args.num_requests, (args.input_min, args.input_max),
                                     (args.output_min, args.output_max), llm.config.model_config.vocab_size,
                                     seed=args.seed, exclude_ids=list(tok.all_special_ids))
        prompts = [r.engine_prompt() for r in reqs]
        params = [SamplingParams(max_tokens=r.expected_output_len, temperature=args.temperature, seed=args.seed + i,
                                 ignore_eos=True) for i, r in enumerate(reqs)]
        llm.generate(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        before = llm.stats()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        after = llm.stats()
    finally:
        llm.shutdown()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    busy, wall = after.busy_s - before.busy_s, after.wall_s - before.wall_s
    return {
        "mode": "async" if async_scheduling else "sync",
        "executor": args.executor,
        "worker_threads": llm.config.num_threads or getattr(llm._executor, "num_threads", None),
        "requests": len(outs), "prompt_tokens": in_tokens, "output_tokens": out_tokens, "elapsed_s": elapsed,
        "output_tok_s": out_tokens / elapsed, "total_tok_s": (in_tokens + out_tokens) / elapsed,
        "forward_steps": after.forward_steps - before.forward_steps,
        "busy_s": busy, "wall_s": wall, "utilization": busy / wall if wall else 0.0,
        "ms_per_step": 1000 * elapsed / max(1, after.forward_steps - before.forward_steps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M-Instruct")
    p.add_argument("--modes", default="async,sync")
    p.add_argument("--executor", default="mp", choices=["mp", "uni"])
    p.add_argument("--num-threads", type=int, default=None, help="worker torch threads (default: executor's)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-min", type=int, default=32)
    p.add_argument("--input-max", type=int, default=256)
    p.add_argument("--output-min", type=int, default=32)
    p.add_argument("--output-max", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args()
    results = []
    for mode in args.modes.split(","):
        r = run_mode(args, async_scheduling=(mode == "async"))
        results.append(r)
        print(f"[{r['mode']:5s} {r['executor']} threads={r['worker_threads']}] {r['requests']} requests, "
              f"{r['prompt_tokens']}+{r['output_tokens']} tokens in {r['elapsed_s']:.1f} s: "
              f"output {r['output_tok_s']:.1f} tok/s, total {r['total_tok_s']:.1f} tok/s, "
              f"{r['forward_steps']} steps ({r['ms_per_step']:.1f} ms/step), utilization {r['utilization']:.3f}",
              flush=True)
    if len(results) == 2:
        print(f"async/sync output throughput: {results[0]['output_tok_s'] / results[1]['output_tok_s']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
