"""The server's cost: 64 concurrent streaming requests through `stepahead serve` vs the offline engine.

Same model, engine flags, prompts (seeded random token ids) and output lengths (ignore_eos, greedy)
in one run. Offline drives the LLM's in-process EngineCore with DELTA outputs so every token gets a
timestamp; the server gets the same prompts as token-id completions over HTTP/SSE, all sent at once.
Reported: output throughput (and the server/offline ratio), TTFT and inter-token latency median/p99.

    .venv/bin/python benchmarks/server_vs_offline.py                 # built-in SmolLM2, 64 x (32 in, 64 out)
    .venv/bin/python benchmarks/server_vs_offline.py --num-requests 16 --output-len 32 --json out.json

Takes a few minutes on 2 shared CPU cores (two model loads plus the two runs); numbers on a shared
machine vary by about +-25% between runs, so compare the ratio, not absolute values across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from stepahead import LLM, SamplingParams
from stepahead.bench.datasets import random_token_requests
from stepahead.engine.output_processor import OutputProcessor, RequestOutputKind

REPO = Path(__file__).resolve().parents[1]


def summarize(name: str, out_tokens: int, duration: float, ttfts: list[float], itls: list[float]) -> dict:
    return {
        "mode": name, "output_tokens": out_tokens, "duration_s": duration, "output_tok_s": out_tokens / duration,
        "ttft_median_ms": 1000 * float(np.median(ttfts)), "ttft_p99_ms": 1000 * float(np.percentile(ttfts, 99)),
        "itl_median_ms": 1000 * float(np.median(itls)), "itl_p99_ms": 1000 * float(np.percentile(itls, 99)),
    }


# -- offline ----------------------------------------------------------------------------------------------


def run_offline(args, prompts: list[list[int]], out_lens: list[int]) -> dict:
    llm = LLM(args.model, **engine_kwargs(args))
    try:
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        core, ip = llm.engine_core, llm.input_processor
        op = OutputProcessor(llm.get_tokenizer())
        t0 = time.perf_counter()
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        itls: list[float] = []
        tokens = 0
        for i, (p, n) in enumerate(zip(prompts, out_lens, strict=True)):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            reqs, text = ip.process(f"r{i}", {"prompt_token_ids": p}, params)
            op.add_request(f"r{i}", reqs, text, RequestOutputKind.DELTA)
            for r in reqs:
                core.add_request(r)
        while op.has_unfinished_requests():
            outs, _ = op.process_outputs(core.step())
            now = time.perf_counter()
            for ro in outs:
                n_new = sum(len(c.token_ids) for c in ro.outputs)
                if not n_new:
                    continue
                tokens += n_new
                if ro.request_id in last:
                    itls.append(now - last[ro.request_id])
                else:
                    first[ro.request_id] = now - t0
                last[ro.request_id] = now
        duration = max(last.values()) - t0
        while core.has_work():
            core.step()
    finally:
        llm.shutdown()
    return summarize("offline LLM", tokens, duration, list(first.values()), itls)


# -- server -----------------------------------------------------------------------------------------------


def start_server(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "stepahead.entrypoints.openai.api_server", *([args.model] if args.model else []),
           "--port", "0", *engine_flags(args)]
    log = open(log_path, "w")  # the server writes it for its whole life
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ,
                                                                                      "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log_path.read_text()}")
        m = re.search(r"serving on (http://\S+)", log_path.read_text())
        if m:
            try:
                if httpx.get(m.group(1) + "/health", timeout=5).status_code == 200:
                    return proc, m.group(1)
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy")


async def one_stream(client: httpx.AsyncClient, prompt: list[int], n: int, t0: float, res: dict) -> None:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    times = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
            elif "usage" in chunk:
                res["tokens"] += chunk["usage"]["completion_tokens"]
    res["ttfts"].append(times[0] - t0)
    res["itls"].extend(np.diff(times).tolist())
    res["last"] = max(res["last"], times[-1])


def run_server(args, prompts: list[list[int]], out_lens: list[int]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(args, Path(tmp) / "server.log")
        try:
            async def go() -> dict:
                limits = httpx.Limits(max_connections=len(prompts) + 4)
                async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as c:
                    warm = {"tokens": 0, "ttfts": [], "itls": [], "last": 0.0}
                    await one_stream(c, prompts[0], 4, time.perf_counter(), warm)
                    res = {"tokens": 0, "ttfts": [], "itls": [], "last": 0.0}
                    t0 = time.perf_counter()
                    await asyncio.gather(*(one_stream(c, p, n, t0, res) for p, n in zip(prompts, out_lens,
                                                                                         strict=True)))
                    res["duration"] = res["last"] - t0
                    return res

            res = asyncio.run(go())
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    return summarize("server (HTTP/SSE)", res["tokens"], res["duration"], res["ttfts"], res["itls"])


# -- main -------------------------------------------------------------------------------------------------


def engine_kwargs(args) -> dict:
    kw = {"executor": args.executor, "max_num_seqs": max(args.num_requests, 1)}
    if args.num_threads:
        kw["num_threads"] = args.num_threads
    return kw


def engine_flags(args) -> list[str]:
    flags = []
    for k, v in engine_kwargs(args).items():
        flags += ["--" + k.replace("_", "-"), str(v)]
    return flags


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M-Instruct")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--executor", default="mp", choices=["mp", "uni"])
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()

    from stepahead.engine.arg_utils import EngineArgs
    from stepahead.models.loading.loader import load_tokenizer

    model_config = EngineArgs(model=args.model).create_engine_config().model_config
    tok = load_tokenizer(model_config)
    reqs = random_token_requests(args.num_requests, (args.input_len, args.input_len),
                                 (args.output_len, args.output_len), model_config.vocab_size, seed=args.seed,
                                 exclude_ids=list(tok.all_special_ids))
    prompts = [list(r.prompt) for r in reqs]
    out_lens = [r.expected_output_len for r in reqs]
    offline = run_offline(args, prompts, out_lens)
    server = run_server(args, prompts, out_lens)
    rows = [offline, server]
    print(f"{args.num_requests} concurrent requests, {args.input_len} prompt tokens, {args.output_len} output tokens, "
          f"model {model_config.model}")
    print(f"{'mode':<20}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}  (ms)")
    for r in rows:
        print(f"{r['mode']:<20}{r['output_tok_s']:>11.1f}{r['ttft_median_ms']:>10.0f}{r['ttft_p99_ms']:>10.0f}"
              f"{r['itl_median_ms']:>9.0f}{r['itl_p99_ms']:>9.0f}")
    ratio = server["output_tok_s"] / offline["output_tok_s"]
    print(f"server / offline output throughput: {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "throughput_ratio": ratio, "args": vars(args)},
                                              indent=2))


if __name__ == "__main__":
    main()
