"""Scheduler overhead per step: schedule() + update_from_output() for N decoding requests.

Async scheduler with a batch queue of depth 2 and prefix caching on, as in the default engine.
The model's outputs are built outside the timed region. Usage:

    .venv/bin/python benchmarks/sched_step.py [--reqs 256] [--steps 500] [--no-prefix-caching] [--sync]
        [--sliding-window W]   (every layer windowed: blocks out of the window go back to the pool)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

from stepahead.config import CacheConfig, SchedulerConfig
from stepahead.core.async_scheduler import AsyncScheduler
from stepahead.core.sched_output import ModelRunnerOutput
from stepahead.core.scheduler import Scheduler
from stepahead.request import Request
from stepahead.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--sliding-window", type=int, default=None)
    args = ap.parse_args()

    max_model_len = 4096
    per_req = -(-(args.prompt_len + args.steps + 64) // args.block_size)
    cls = Scheduler if args.sync else AsyncScheduler
    sched = cls(SchedulerConfig(max_num_seqs=args.reqs, max_num_batched_tokens=8192, max_model_len=max_model_len),
                CacheConfig(block_size=args.block_size, num_blocks=args.reqs * per_req + 1,
                            enable_prefix_caching=not args.no_prefix_caching, sliding_window=args.sliding_window))
    shared = list(range(1000, 1000 + args.prompt_len // 2))  # half of every prompt is a shared prefix
    for i in range(args.reqs):
        prompt = shared + [i % 50000 + 10] * (args.prompt_len - len(shared))
        sched.add_request(Request(f"req-{i}", prompt, SamplingParams(max_tokens=100_000), eos_token_id=2))

    depth = 1 if args.sync else 2
    queue: deque = deque()
    tok = 0

    def fake_output(so):
        nonlocal tok
        tok += 1
        ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(ids, [[tok % 30000 + 3] for _ in ids])

    # Wall time, and this thread's CPU time (robust when other processes share the cores).
    times: list[float] = []
    cpu: list[float] = []
    for step in range(args.steps + 20):  # the first 20 steps (prefill) are not counted
        t0, c0 = time.perf_counter(), time.thread_time()
        so = sched.schedule()
        t1, c1 = time.perf_counter(), time.thread_time()
        out = fake_output(so)
        queue.append((so, out))
        t_upd = c_upd = 0.0
        if len(queue) >= depth:
            so_old, out_old = queue.popleft()
            t2, c2 = time.perf_counter(), time.thread_time()
            sched.update_from_output(so_old, out_old)
            t_upd, c_upd = time.perf_counter() - t2, time.thread_time() - c2
        if step >= 20:
            times.append((t1 - t0) + t_upd)
            cpu.append((c1 - c0) + c_upd)
    assert len(sched.running) == args.reqs, "all requests must be decoding"
    ms = [t * 1e3 for t in times]
    print(f"{'sync' if args.sync else 'async'} scheduler, {args.reqs} decoding requests, prefix caching "
          f"{'off' if args.no_prefix_caching else 'on'}, block_size {args.block_size}, sliding window "
          f"{args.sliding_window}: schedule+update per step "
          f"mean {statistics.mean(ms):.3f} ms, median {statistics.median(ms):.3f} ms, "
          f"p99 {sorted(ms)[int(len(ms) * 0.99)]:.3f} ms; CPU time mean {statistics.mean(cpu) * 1e3:.3f} ms "
          f"over {len(ms)} steps; {sched.kv_cache_manager.num_window_freed_blocks} blocks left the window")


if __name__ == "__main__":
    main()
