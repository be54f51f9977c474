"""ms per ModelRunner step on the built-in model (or --model): decode at several batch sizes over a
given context, and one long prefill.

    .venv/bin/python benchmarks/runner_step.py --threads 2 --batch 1 16 64 --context 256 --prefill 512

Decode rows start from a context claimed as already computed (the KV contents do not matter for speed),
so no long prefill is needed to set the benchmark up. A decode figure is the wall time of --steps
consecutive steps divided by their number, the device synchronized at both ends: on CUDA the runner
returns before the GPU is done (async outputs), so one step's host time would say nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from stepahead.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from stepahead.engine.arg_utils import EngineArgs
from stepahead.sampling_params import SamplingParams
from stepahead.worker.model_runner import ModelRunner


def _sync(runner: ModelRunner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize()


def _step(runner: ModelRunner, so: SchedulerOutput) -> float:
    _sync(runner)
    t0 = time.perf_counter()
    if runner.execute_model(so) is None:
        runner.sample_tokens(None)
    _sync(runner)
    return (time.perf_counter() - t0) * 1e3


def bench_decode(runner: ModelRunner, batch: int, context: int, steps: int, bs: int, next_block: int, tag: str):
    greedy = SamplingParams(temperature=0.0)
    blocks_per = -(-(context + steps + 4) // bs)
    new, tables = [], {}
    for b in range(batch):
        rid = f"{tag}{b}"
        tables[rid] = list(range(next_block, next_block + blocks_per))
        next_block += blocks_per
        new.append(NewRequestData(rid, [7] * context, greedy, tables[rid], context - 1))
    ids = list(tables)

    def decode(s: int) -> None:
        cd = CachedRequestData(req_ids=list(ids), new_block_ids=[None] * batch,
                               num_computed_tokens=[context + s] * batch, num_output_tokens=[s + 1] * batch)
        if runner.execute_model(SchedulerOutput([], cd, dict.fromkeys(ids, 1), batch, set())) is None:
            runner.sample_tokens(None)

    _step(runner, SchedulerOutput(new, CachedRequestData(), dict.fromkeys(ids, 1), batch, set()))
    for s in range(3):  # warm-up
        decode(s)
    _sync(runner)
    t0 = time.perf_counter()
    for s in range(3, 3 + steps):
        decode(s)
    _sync(runner)
    ms = (time.perf_counter() - t0) * 1e3 / steps
    # Release the worker state so the next batch starts clean.
    runner.execute_model(SchedulerOutput.make_empty(set(ids)))
    return ms


def bench_prefill(runner: ModelRunner, n: int, reps: int, next_block: int, bs: int) -> float:
    times, finished = [], set()
    for r in range(reps):
        rid = f"p{r}"
        blocks = list(range(next_block, next_block + -(-n // bs)))
        so = SchedulerOutput([NewRequestData(rid, list(range(10, 10 + n)), SamplingParams(temperature=0.0),
                                             blocks, 0)], CachedRequestData(), {rid: n}, n, finished)
        times.append(_step(runner, so))
        finished = {rid}
    return statistics.median(times)


def bench_transformers(hf_config: dict, batch: int, context: int, steps: int) -> float:
    """The same decode step through transformers (random weights of the same shape, DynamicCache)."""
    import transformers

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "max_position_embeddings")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: hf_config[k] for k in keys if k in hf_config}))
    model.eval()
    c = model.config
    hd = c.hidden_size // c.num_attention_heads
    cache = transformers.DynamicCache(config=c)
    for layer in range(c.num_hidden_layers):
        kv = torch.randn(batch, c.num_key_value_heads, context, hd)
        cache.update(kv, kv.clone(), layer)
    times = []
    with torch.inference_mode():
        for s in range(steps + 3):
            ids = torch.full((batch, 1), 7)
            pos = torch.full((batch, 1), context + s)
            t0 = time.perf_counter()
            logits = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).logits
            logits[:, -1].argmax(-1)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto", help="'dummy': random weights of the model's shape")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hf", action="store_true", help="also time transformers' decode step for the same shapes")
    args = ap.parse_args()
    bs = args.block_size
    max_b = max(args.batch)
    max_model_len = max(256, args.context + args.steps + 8, args.prefill)
    num_blocks = 1 + max(max_b * -(-(args.context + args.steps + 4) // bs) + -(-args.prefill // bs),
                         -(-max_model_len // bs))
    cfg = EngineArgs(model=args.model, dtype=args.dtype, load_format=args.load_format, device=args.device,
                     block_size=bs, num_kv_blocks=num_blocks,
                     max_model_len=max_model_len,
                     max_num_batched_tokens=max(512, args.prefill), max_num_seqs=max(64, max_b),
                     num_threads=args.threads, executor="uni").create_engine_config()
    runner = ModelRunner(cfg)
    print(f"model={cfg.model_config.model} dtype={cfg.model_config.dtype} device={cfg.device} "
          f"attention={cfg.attention_backend} graphs={runner.decode_graphs is not None} threads={torch.get_num_threads()}")
    figures: dict = {"model": cfg.model_config.model, "dtype": cfg.model_config.dtype, "device": cfg.device,
                     "context": args.context, "decode_ms": {}}
    for b in args.batch:
        ms = bench_decode(runner, b, args.context, args.steps, bs, 1, tag=f"d{b}_")
        figures["decode_ms"][b] = ms
        line = f"decode  batch={b:<3d} context={args.context}: {ms:7.2f} ms/step  ({b / ms * 1e3:6.0f} tok/s)"
        if args.hf:
            hf = bench_transformers(cfg.model_config.hf_config, b, args.context, args.steps)
            line += f"   transformers {hf:7.1f} ms/step  (x{hf / ms:.2f})"
        print(line)
    if args.prefill:
        ms = bench_prefill(runner, args.prefill, 3, 1, bs)
        figures["prefill_ms"] = ms
        print(f"prefill {args.prefill} tokens: {ms:7.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
