"""Offline throughput and worker utilization of LLM.generate: async (step-ahead) vs sync scheduling.

Built-in model by default; N requests of random token ids, input and output lengths uniform in the
given ranges from a seed, ignore_eos, all submitted in one generate call. Every configuration gets
its own engine, loaded up front; with --rounds > 1 the configurations take turns, so that load from
other users of a shared machine falls on all of them alike, and the median round is reported.

    .venv/bin/python benchmarks/offline_throughput.py                      # 64 requests, 32-256 / 32-256
    .venv/bin/python benchmarks/offline_throughput.py --configs async:1,sync:1,async:2,sync:2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from stepahead import LLM, SamplingParams
from stepahead.bench.datasets import random_token_requests


def parse_config(text: str) -> tuple[str, int | None]:
    """"async" or "sync", optionally ":THREADS" (worker torch threads)."""
    mode, _, threads = text.partition(":")
    if mode not in ("async", "sync"):
        raise ValueError(f"--configs entries must be async[:THREADS] or sync[:THREADS], got {text!r}")
    return mode, int(threads) if threads else None


def run_round(llm: LLM, label: str, prompts: list, params: list) -> dict:
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    after = llm.stats()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    busy, wall = after.busy_s - before.busy_s, after.wall_s - before.wall_s
    steps = after.forward_steps - before.forward_steps
    return {
        "config": label, "requests": len(outs), "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "elapsed_s": elapsed, "output_tok_s": out_tokens / elapsed, "total_tok_s": (in_tokens + out_tokens) / elapsed,
        "forward_steps": steps, "ms_per_step": 1000 * elapsed / max(1, steps),
        "busy_s": busy, "wall_s": wall, "utilization": busy / wall if wall else 0.0,
    }


def line(r: dict) -> str:
    return (f"[{r['config']:>8s}] {r['requests']} requests, {r['prompt_tokens']}+{r['output_tokens']} tokens in "
            f"{r['elapsed_s']:.1f} s: output {r['output_tok_s']:.1f} tok/s, total {r['total_tok_s']:.1f} tok/s, "
            f"{r['forward_steps']} steps ({r['ms_per_step']:.1f} ms/step), utilization {r['utilization']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M-Instruct")
    p.add_argument("--configs", default="async,sync", help="comma-separated async[:THREADS] / sync[:THREADS]")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--executor", default="mp", choices=["mp", "uni"])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-min", type=int, default=32)
    p.add_argument("--input-max", type=int, default=256)
    p.add_argument("--output-min", type=int, default=32)
    p.add_argument("--output-max", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every round's results to this file")
    args = p.parse_args()

    engines: dict[str, LLM] = {}
    try:
        for text in args.configs.split(","):
            mode, threads = parse_config(text)
            llm = LLM(args.model, async_scheduling=(mode == "async"), executor=args.executor, num_threads=threads)
            engines[f"{mode}:{llm._executor.num_threads}"] = llm
        first = next(iter(engines.values()))
        reqs = random_token_requests(args.num_requests, (args.input_min, args.input_max),
                                     (args.output_min, args.output_max), first.config.model_config.vocab_size,
                                     seed=args.seed, exclude_ids=list(first.get_tokenizer().all_special_ids))
        prompts = [r.engine_prompt() for r in reqs]
        params = [SamplingParams(max_tokens=r.expected_output_len, temperature=args.temperature, seed=args.seed + i,
                                 ignore_eos=True) for i, r in enumerate(reqs)]
        for llm in engines.values():  # warm-up
            llm.generate(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        results: list[dict] = []
        for k in range(args.rounds):
            for label, llm in engines.items():
                r = run_round(llm, label, prompts, params) | {"round": k}
                results.append(r)
                print(f"round {k + 1}/{args.rounds} {line(r)}", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    print("median over rounds:")
    for label in engines:
        rows = [r for r in results if r["config"] == label]
        print(f"  {label:>8s}: output {statistics.median(r['output_tok_s'] for r in rows):.1f} tok/s, "
              f"{statistics.median(r['ms_per_step'] for r in rows):.1f} ms/step, "
              f"utilization {statistics.median(r['utilization'] for r in rows):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
