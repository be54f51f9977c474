"""`stepahead bench serve`: an asyncio load generator for any OpenAI-compatible server.

It mirrors `vllm bench serve`: streamed requests with stream_options.include_usage, Poisson or
gamma arrivals at --request-rate, a --max-concurrency semaphore, vLLM's metric definitions, printout
and result-file keys. Without --model it sends the server's first model of /v1/models, and without
--tokenizer it builds prompts with that model's tokenizer, as vLLM's client does. Token counts come
from the usage chunk. One difference, on purpose: a streamed chunk counts as a token event only when
it carries text, so a chat server's role-only first chunk does not pass for the first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from stepahead.bench import spec_counters
from stepahead.bench.copy_dataset import copy_heavy_requests
from stepahead.bench.datasets import (
    SampleRequest,
    length_bounds,
    load_jsonl_requests,
    random_text_requests,
    random_token_requests,
)
from stepahead.bench.report import now_utc, write_json
from stepahead.bench.serve_metrics import METRICS, RequestResult, compute_metrics, format_result

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


# -- one request ------------------------------------------------------------------------------------------


def build_payload(ns, model: str, req: SampleRequest) -> dict:
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if ns.endpoint == "/v1/chat/completions":
        if not isinstance(req.prompt, str):
            raise ValueError("the chat endpoint needs text prompts: use --prompt-format text")
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.expected_output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.expected_output_len
    if ns.ignore_eos:
        body["ignore_eos"] = True
    if ns.temperature is not None:
        body["temperature"] = ns.temperature
    if ns.extra_body:
        body.update(json.loads(ns.extra_body))
    return body


def _chunk_text(choice: dict) -> str:
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(client, url: str, payload: dict, headers: dict, req: SampleRequest) -> RequestResult:
    """Stream one request; time the first text chunk (TTFT) and each gap after it (ITL)."""
    import httpx

    result = RequestResult(prompt_len=req.prompt_len)
    text: list[str] = []
    started = time.perf_counter()
    result.start_time = last = started
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:500]}"
                return result
            async for line in response.aiter_lines():
                line = line.strip()
                if not line or line.startswith(":"):
                    continue
                data_str = line.removeprefix("data:").strip()
                if data_str == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(data_str)
                if "error" in data and not data.get("choices"):
                    result.error = f"stream error: {data['error']}"
                    return result
                piece = "".join(_chunk_text(choice) for choice in data.get("choices") or [])
                if piece:
                    if result.ttft == 0.0:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last = now
                    text.append(piece)
                usage = data.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.generated_text = "".join(text)
    if result.ttft == 0.0:
        result.error = "Never received a valid chunk to calculate TTFT."
        return result
    result.latency = last - started
    result.success = True
    return result


# -- the run -----------------------------------------------------------------------------------------------


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Inter-arrival gaps: gamma(shape=burstiness, mean 1/rate), rescaled so they sum to n / rate (as vLLM)."""
    if rate == float("inf"):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    total = gaps.sum()
    return gaps * ((n / rate) / total) if total > 0 else gaps


async def run_requests(ns, url: str, model: str, requests: list[SampleRequest], headers: dict,
                       gaps: np.ndarray, progress: bool) -> tuple[list[RequestResult], float]:
    import httpx

    limit = ns.max_concurrency or len(requests)
    semaphore = asyncio.Semaphore(limit)
    timeout = httpx.Timeout(6 * 3600.0, connect=30.0)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc="requests", unit="req")

    async def one(client, req):
        async with semaphore:
            result = await send_request(client, url, build_payload(ns, model, req), headers, req)
        if bar is not None:
            bar.update(1)
        return result

    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=limit + 4)) as client:
        started = time.perf_counter()
        tasks = []
        for req, gap in zip(requests, gaps, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(client, req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    if bar is not None:
        bar.close()
    return list(results), duration


def resolve_model(base_url: str, model: str | None, headers: dict) -> tuple[str, str | None]:
    """The model name to send, and where the server loaded it from (its "root" in /v1/models, or None).

    Without --model: the server's first model, as vLLM's client.
    """
    import httpx

    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
        response.raise_for_status()
        cards = list(response.json()["data"])
        if model is None:
            model = cards[0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
        if model is None:
            raise ValueError(f"model not given and {base_url}/v1/models did not name one: {e}") from e
        cards = []  # a server without /v1/models: the given name is all there is
    root = next((card.get("root") for card in cards if isinstance(card, dict) and card.get("id") == model), None)
    return model, root


def load_local_tokenizer(source: str) -> Any | None:
    """The tokenizer of a local folder, a .gguf file or a model in the local Hugging Face cache; None if
    there is none (no model hub is asked)."""
    import transformers

    path = Path(source)
    if path.suffix == ".gguf":
        return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name) if path.is_file() else None
    try:
        return transformers.AutoTokenizer.from_pretrained(source, local_files_only=True)
    except OSError:  # not a folder, not cached, or not a valid model id
        return None


def prompt_tokenizer(tokenizer_flag: str | None, model: str, root: str | None) -> tuple[Any, str]:
    """The tokenizer to build prompts with, and where it came from.

    --tokenizer when given; else the served model's name, then its root (as vLLM's client, which uses
    the model name). Raises ValueError, in one line, when none of them holds a tokenizer.
    """
    if tokenizer_flag is not None:
        tokenizer = load_local_tokenizer(tokenizer_flag)
        if tokenizer is None:
            raise ValueError(f"tokenizer {tokenizer_flag!r} is not a local folder, .gguf file or cached model")
        return tokenizer, tokenizer_flag
    tried: list[tuple[str, str]] = []
    for what, source in (("the served model's name", model), ("its root on the server", root)):
        if source is None or any(source == tried_source for _, tried_source in tried):
            continue
        tokenizer = load_local_tokenizer(source)
        if tokenizer is not None:
            return tokenizer, source
        tried.append((what, source))
    attempts = " and ".join(f"{what} {source!r}" for what, source in tried)
    raise ValueError(f"tokenizer not found: tried {attempts} (not a local folder, .gguf file or cached model); "
                     "pass --tokenizer FOLDER (or FILE.gguf)")


def build_requests(ns, tokenizer) -> list[SampleRequest]:
    if ns.dataset_name == "copy":
        return copy_heavy_requests(tokenizer, ns.num_prompts, ns.random_output_len, ns.seed)
    if ns.dataset_path:
        return load_jsonl_requests(ns.dataset_path, ns.num_prompts, ns.random_output_len, tokenizer)
    in_range = length_bounds(ns.random_input_len, ns.random_range_ratio)
    out_range = length_bounds(ns.random_output_len, ns.random_range_ratio)
    if ns.prompt_format == "token-ids":
        special = list(getattr(tokenizer, "all_special_ids", []) or [])
        return random_token_requests(ns.num_prompts, in_range, out_range, len(tokenizer), ns.seed, special)
    return random_text_requests(tokenizer, ns.num_prompts, in_range, out_range, ns.seed)


def validate(ns) -> None:
    if ns.endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {ns.endpoint!r}")
    if ns.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {ns.num_prompts}")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {ns.max_concurrency}")
    if not ns.request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {ns.request_rate}")
    if not ns.burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {ns.burstiness}")
    if ns.dataset_name == "jsonl" and not ns.dataset_path:
        raise ValueError("dataset_name jsonl needs --dataset-path")
    if (ns.prompt_format == "token-ids" or ns.dataset_name == "copy") and ns.endpoint == "/v1/chat/completions":
        raise ValueError("prompt_format token-ids needs endpoint /v1/completions (chat messages are text)")
    unknown = [metric for metric in ns.percentile_metrics.split(",") if metric not in METRICS]
    if unknown:
        raise ValueError(f"percentile_metrics must be a comma list of {METRICS}, got {unknown}")


def main(ns: argparse.Namespace) -> int:
    validate(ns)
    base_url = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"} if os.environ.get("OPENAI_API_KEY") else {}
    model, root = resolve_model(base_url, ns.model, headers)
    tokenizer, tokenizer_source = prompt_tokenizer(ns.tokenizer, model, root)
    requests = build_requests(ns, tokenizer)
    url = base_url + ns.endpoint
    selected = ns.percentile_metrics.split(",")
    percentiles = [float(p) for p in ns.metric_percentiles.split(",")]
    if ns.num_warmups > 0:
        print(f"Warming up with {ns.num_warmups} requests...")
        warm = [requests[index % len(requests)] for index in range(ns.num_warmups)]
        asyncio.run(run_requests(ns, url, model, warm, headers, np.zeros(len(warm)), False))
    print(f"Traffic request rate: {ns.request_rate}; burstiness: {ns.burstiness}; "
          f"maximum request concurrency: {ns.max_concurrency}")
    gaps = arrival_gaps(len(requests), ns.request_rate, ns.burstiness, ns.seed)
    counters_before = spec_counters.scrape(base_url, headers)
    results, duration = asyncio.run(run_requests(ns, url, model, requests, headers, gaps, not ns.disable_tqdm))
    metrics = compute_metrics(results, duration, percentiles, selected)
    print(format_result(metrics, ns.max_concurrency, ns.request_rate, percentiles, selected))
    spec = spec_counters.acceptance(counters_before, spec_counters.scrape(base_url, headers))
    if spec is not None:  # the server drafts: its acceptance over this run
        metrics.update(spec)
        print(f"Speculative decoding: {spec['spec_num_accepted_tokens']:.0f} of {spec['spec_num_draft_tokens']:.0f} "
              f"drafts accepted, mean accepted length {spec['spec_mean_accepted_length']:.2f}")
    errors = [result.error for result in results if not result.success]
    if errors:
        print(f"first error: {errors[0]}")
    if ns.save_result or ns.result_filename:
        save(ns, model, tokenizer_source, metrics, results)
    return 0 if metrics["completed"] > 0 else 1


def save(ns, model: str, tokenizer_source: str, metrics: dict, results: list[RequestResult]) -> Path:
    rate = "inf" if ns.request_rate == float("inf") else ns.request_rate
    payload = {"date": time.strftime("%Y%m%d-%H%M%S"), "date_utc": now_utc(), "endpoint_type": "openai",
               "backend": "openai-chat" if "chat" in ns.endpoint else "openai", "label": ns.label,
               "model_id": model, "tokenizer_id": tokenizer_source, "num_prompts": len(results),
               "request_rate": rate, "burstiness": ns.burstiness, "max_concurrency": ns.max_concurrency, **metrics}
    if ns.save_detailed:
        payload.update(input_lens=[result.prompt_len for result in results],
                       output_lens=[result.output_tokens for result in results],
                       ttfts=[result.ttft for result in results], itls=[result.itl for result in results],
                       start_times=[result.start_time for result in results],
                       generated_texts=[result.generated_text for result in results],
                       errors=[result.error for result in results])
    name = ns.result_filename
    if not name:
        concurrency = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency else ""
        name = f"{ns.label or 'openai'}-{rate}qps{concurrency}-{Path(model).name}-{payload['date']}.json"
    path = write_json(Path(ns.result_dir or ".") / name, payload)
    print(f"result: {path}")
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    g.add_argument("--model", default=None, help="model name sent in requests (default: the server's first)")
    g.add_argument("--tokenizer", default=None,
                   help="local folder, .gguf file or cached model id for building prompts (default: the served "
                        "model's, found by its name or its root in /v1/models)")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=["random", "jsonl", "copy"],
                   help="random prompts, jsonl (with --dataset-path), or copy: prompts whose answers copy from "
                        "them, as token ids (bench/copy_dataset.py; output budget --random-output-len)")
    g.add_argument("--dataset-path", default=None, help="JSONL: one {\"prompt\" | \"prompt_token_ids\", "
                   "\"output_len\"?} a line (implies --dataset-name jsonl)")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128, help="also the output budget of JSONL prompts")
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--prompt-format", choices=["text", "token-ids"], default="text",
                   help="random prompts as text (any endpoint) or token-id lists (completions only)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default: inf, all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    g.add_argument("--num-warmups", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so outputs reach their length")
    g.add_argument("--temperature", type=float, default=None, help="(default: not sent; the server's default)")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    g.add_argument("--disable-tqdm", action="store_true")
    g = p.add_argument_group("results")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    g.add_argument("--metric-percentiles", default="99")
    g.add_argument("--save-result", action="store_true")
    g.add_argument("--save-detailed", action="store_true", help="also per-request arrays")
    g.add_argument("--result-dir", default=None)
    g.add_argument("--result-filename", default=None)
    g.add_argument("--label", default=None)
