"""`stepahead bench throughput`: offline, in-process throughput on nano-vllm's protocol.

N sequences of random token ids, input and output lengths uniform in [min, max] from a seed,
ignore_eos, all submitted at once to LLM.generate. Prints output and total tok/s plus the engine's
own accounting (host and GPU utilization = worker host time or device time / engine wall time, wasted
request-steps, preemptions).

--compare sync     runs the step-ahead (async) and the synchronous scheduler alternately, each in
                   its own engine kept alive across rounds, and prints the per-round and median ratio.
--compare spec     runs --speculative-config against --baseline-speculative-config (another proposer
                   or setting) alternately, each in its own engine kept alive across rounds.
--compare transformers  runs transformers `generate` (padded static batches) and `generate_batch`
                   (continuous batching) on the same prompts and checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from stepahead.bench.copy_dataset import copy_heavy_requests
from stepahead.bench.datasets import SampleRequest, load_jsonl_requests, random_token_requests
from stepahead.bench.report import (
    TokenRates,
    command_line,
    engine_args_dict,
    machine_info,
    now_utc,
    write_json,
)
from stepahead.bench.trace import by_start
from stepahead.engine.arg_utils import EngineArgs
from stepahead.outputs import EngineStats, device_time_measured
from stepahead.tracing import TraceEvent


@dataclass
class RunResult(TokenRates):
    label: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    forward_steps: int
    wasted_request_steps: int
    busy_s: float  # the worker's host time in step calls
    gpu_busy_s: float  # the steps' device time (CUDA events; on CPU the host time)
    wall_s: float
    preemptions: int
    stop_finishes: int  # requests finished by EOS or a stop token
    round: int = 0
    spec_num_drafts: int = 0  # request-steps that verified drafts (speculative decoding)
    spec_num_accepted_tokens: int = 0
    device: str = "cpu"  # where gpu_busy_s is the host time again (CPU), only host utilization is printed
    events: list[TraceEvent] = field(default_factory=list, repr=False)  # the run's trace, when recorded

    @property
    def host_utilization(self) -> float:
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per drafting request-step: 1 + accepted drafts (0 without speculation)."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def gpu_utilization(self) -> float:
        return self.gpu_busy_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        figures = {name: value for name, value in dataclasses.asdict(self).items() if name != "events"}
        figures.update(output_tok_s=self.output_tok_s, total_tok_s=self.total_tok_s,
                       host_utilization=self.host_utilization, gpu_utilization=self.gpu_utilization,
                       requests_per_s=self.num_requests / self.elapsed_s, mean_accepted_length=self.mean_accepted_length)
        return figures

    def utilization_text(self, digits: int = 1) -> str:
        """"host utilization H, GPU utilization G"; on CPU the host figure alone (the two are equal there)."""
        text = f"host utilization {self.host_utilization:.{digits}%}"
        if not device_time_measured(self.device):
            return text
        return f"{text}, GPU utilization {self.gpu_utilization:.{digits}%}"

    def plot_label(self) -> str:
        return f"{self.label} ({self.output_tok_s:.0f} tok/s, {self.utilization_text(0)})"

    def line(self) -> str:
        waste = f"wasted request-steps {self.wasted_request_steps}"
        if self.stop_finishes:
            waste += f" ({self.wasted_request_steps / self.stop_finishes:.2f} per EOS finish)"
        spec = f", mean accepted length {self.mean_accepted_length:.2f}" if self.spec_num_drafts else ""
        return (f"[{self.label}] {self.num_requests} requests, {self.prompt_tokens} prompt + {self.output_tokens} "
                f"output tokens in {self.elapsed_s:.2f} s: output {self.output_tok_s:.1f} tok/s, total "
                f"{self.total_tok_s:.1f} tok/s | {self.utilization_text()}, forward steps "
                f"{self.forward_steps}, {waste}, preemptions {self.preemptions}{spec}")


# -- engines --------------------------------------------------------------------------------------------


def make_llm(engine_args: EngineArgs, async_scheduling: bool | None, trace: bool, speculative: bool = True):
    """An LLM from the CLI's engine args with the scheduler mode (and tracing) forced; without
    speculative decoding when not `speculative`."""
    from stepahead.engine.llm import LLM

    changes: dict = {"trace": trace or engine_args.trace}
    if not speculative:
        changes["speculative_config"] = None
    if async_scheduling is not None:
        changes["async_scheduling"] = async_scheduling
        if not async_scheduling:
            changes["max_concurrent_batches"] = None  # a queue depth > 1 would contradict sync
    args = dataclasses.replace(engine_args, **changes)
    return LLM(**{name: getattr(args, name) for name in EngineArgs.field_names()})


def mode_label(llm) -> str:
    """"sync", "async", or "async-depth3" when the batch queue is deeper than the usual 2."""
    if not llm.config.async_scheduling:
        return "sync"
    depth = llm.config.max_concurrent_batches
    return "async" if depth == 2 else f"async-depth{depth}"


def drain_events(llm) -> list[TraceEvent]:
    """The engine's trace events since the last drain, in time order ([] when tracing is off)."""
    return by_start(llm.drain_trace_events()) if llm.config.trace else []


def workload(llm, ns) -> list[SampleRequest]:
    """Random token ids (nano-vllm's protocol), the copy-heavy prompts (--dataset copy), or
    --dataset-path prompts turned into token ids."""
    tokenizer = llm.get_tokenizer()
    if getattr(ns, "dataset", "random") == "copy":
        return copy_heavy_requests(tokenizer, ns.num_prompts, ns.output_len[1], ns.seed)
    if getattr(ns, "dataset_path", None):
        rows = load_jsonl_requests(ns.dataset_path, ns.num_prompts, ns.output_len[1], tokenizer)
        # Token ids for every engine alike; the text may hold a chat template's special tokens.
        return [row if not isinstance(row.prompt, str) else
                SampleRequest(ids := tokenizer.encode(row.prompt, add_special_tokens=False), len(ids),
                              row.expected_output_len)
                for row in rows]
    special = list(getattr(tokenizer, "all_special_ids", []) or [])
    return random_token_requests(ns.num_prompts, ns.input_len, ns.output_len, llm.config.model_config.vocab_size,
                                 ns.seed, special)


def sampling_params(requests: list[SampleRequest], temperature: float, ignore_eos: bool):
    from stepahead.sampling_params import SamplingParams

    return [SamplingParams(max_tokens=request.expected_output_len, temperature=temperature, ignore_eos=ignore_eos)
            for request in requests]


def warm_up(llm, requests: list[SampleRequest]) -> None:
    """One short request: first-call costs (allocator, lazy imports) stay out of the timed runs."""
    from stepahead.sampling_params import SamplingParams

    llm.generate({"prompt_token_ids": list(requests[0].prompt[:16])}, SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    drain_events(llm)


def run_once(llm, label: str, requests: list[SampleRequest], params, use_tqdm: bool = False,
             round_index: int = 0) -> RunResult:
    drain_events(llm)
    before: EngineStats = llm.stats()
    started = time.perf_counter()
    outputs = llm.generate([request.engine_prompt() for request in requests], params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - started
    after: EngineStats = llm.stats()
    stops = after.finished_by_reason.get("stop", 0) - before.finished_by_reason.get("stop", 0)
    return RunResult(
        label=label, elapsed_s=elapsed, num_requests=len(outputs),
        prompt_tokens=sum(len(output.prompt_token_ids) for output in outputs),
        output_tokens=sum(len(completion.token_ids) for output in outputs for completion in output.outputs),
        forward_steps=after.forward_steps - before.forward_steps,
        wasted_request_steps=after.wasted_request_steps - before.wasted_request_steps,
        busy_s=after.busy_s - before.busy_s, gpu_busy_s=after.gpu_busy_s - before.gpu_busy_s, wall_s=after.wall_s - before.wall_s,
        preemptions=after.preemptions - before.preemptions, stop_finishes=stops,
        round=round_index, device=after.device, events=drain_events(llm),
        spec_num_drafts=after.spec_num_drafts - before.spec_num_drafts,
        spec_num_accepted_tokens=after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
    )


# -- the three modes ------------------------------------------------------------------------------------


def run_single(ns, engine_args: EngineArgs, tracing: bool) -> dict:
    llm = make_llm(engine_args, None, tracing)
    try:
        requests = workload(llm, ns)
        warm_up(llm, requests)
        label = mode_label(llm)
        result = run_once(llm, label, requests, sampling_params(requests, ns.temperature, ns.ignore_eos),
                          ns.progress)
    finally:
        llm.shutdown()
    print(result.line())
    return {"runs": [result], "summary": result.to_dict()}


def run_compare_sync(ns, engine_args: EngineArgs, tracing: bool) -> dict:
    return run_compare(ns, {"async": lambda: make_llm(engine_args, True, tracing),
                            "sync": lambda: make_llm(engine_args, False, tracing)})


def run_compare_nospec(ns, engine_args: EngineArgs, tracing: bool) -> dict:
    if engine_args.speculative_config is None:
        raise ValueError("--compare nospec needs --speculative-config")
    return run_compare(ns, {"spec": lambda: make_llm(engine_args, None, tracing),
                            "nospec": lambda: make_llm(engine_args, None, tracing, speculative=False)})


def run_compare_spec(ns, engine_args: EngineArgs, tracing: bool) -> dict:
    if engine_args.speculative_config is None or ns.baseline_speculative_config is None:
        raise ValueError("--compare spec needs --speculative-config and --baseline-speculative-config")
    baseline = dataclasses.replace(engine_args, speculative_config=ns.baseline_speculative_config)
    return run_compare(ns, {"spec": lambda: make_llm(engine_args, None, tracing),
                            "baseline": lambda: make_llm(baseline, None, tracing)})


def run_compare(ns, makers: dict[str, Any]) -> dict:
    """Two engines (the first measured against the second) in alternating rounds on the same requests."""
    first, second = makers
    engines: dict[str, Any] = {}
    try:
        for label, make in makers.items():
            engines[label] = make()
        requests = workload(engines[first], ns)
        params = sampling_params(requests, ns.temperature, ns.ignore_eos)
        for llm in engines.values():
            warm_up(llm, requests)
        runs: list[RunResult] = []
        ratios = []
        started = time.perf_counter()
        for round_index in range(ns.rounds):
            spent = time.perf_counter() - started
            if round_index > 0 and ns.time_budget and spent * (round_index + 1) / round_index > ns.time_budget:
                print(f"stopping after {round_index} of {ns.rounds} rounds: another would pass --time-budget "
                      f"{ns.time_budget:g} s")
                break
            # Alternate which engine goes first so slow drift of a shared machine hits both alike.
            order = (first, second) if round_index % 2 == 0 else (second, first)
            pair = {label: run_once(engines[label], label, requests, params, ns.progress, round_index + 1)
                    for label in order}
            runs += [pair[second], pair[first]]
            ratios.append(pair[first].output_tok_s / pair[second].output_tok_s)
            print(f"round {round_index + 1}/{ns.rounds}", flush=True)
            print("  " + pair[second].line())
            print("  " + pair[first].line())
            print(f"  {first} / {second} output throughput: {ratios[-1]:.3f}")
    finally:
        for llm in engines.values():
            llm.shutdown()
    summary: dict[str, Any] = {
        mode: {
            "output_tok_s_median": statistics.median(run.output_tok_s for run in runs if run.label == mode),
            "total_tok_s_median": statistics.median(run.total_tok_s for run in runs if run.label == mode),
            "host_utilization_median": statistics.median(run.host_utilization for run in runs if run.label == mode),
            "gpu_utilization_median": statistics.median(run.gpu_utilization for run in runs if run.label == mode),
            "wasted_request_steps": [run.wasted_request_steps for run in runs if run.label == mode],
            "preemptions": [run.preemptions for run in runs if run.label == mode],
            "mean_accepted_length": [run.mean_accepted_length for run in runs if run.label == mode],
        }
        for mode in (second, first)
    }
    summary["ratios"] = ratios
    summary["rounds_run"] = len(ratios)
    summary["ratio_median"] = statistics.median(ratios)
    # On CPU the two figures are the same time: the host one alone is printed.
    side, name = ("gpu", "GPU utilization") if device_time_measured(runs[0].device) else ("host", "host utilization")
    print(f"median over {len(ratios)} rounds: {second} {summary[second]['output_tok_s_median']:.1f} tok/s "
          f"({name} {summary[second][f'{side}_utilization_median']:.1%}), {first} "
          f"{summary[first]['output_tok_s_median']:.1f} tok/s ({name} "
          f"{summary[first][f'{side}_utilization_median']:.1%}); {first} / {second} = {summary['ratio_median']:.3f}")
    return {"runs": runs, "summary": summary}


def run_compare_transformers(ns, engine_args: EngineArgs, tracing: bool) -> dict:
    import torch

    from stepahead.bench.hf_baseline import load_hf_model, run_generate, run_generate_batch

    llm = make_llm(engine_args, None, tracing)
    try:
        requests = workload(llm, ns)
        warm_up(llm, requests)
        label = "stepahead " + mode_label(llm)
        ours = run_once(llm, label, requests, sampling_params(requests, 0.0, True), ns.progress)
        device, dtype = llm.config.device, llm.config.model_config.dtype
        step_tokens = llm.config.scheduler_config.max_num_batched_tokens
    finally:
        llm.shutdown()
    print(ours.line())
    hf_model = load_hf_model(engine_args.model, engine_args.load_format).to(device=device,
                                                                            dtype=getattr(torch, dtype))
    batch_size = ns.hf_batch_size or min(engine_args.max_num_seqs, len(requests))
    baselines = []
    if "generate" in ns.hf_baselines:
        baselines.append(run_generate(hf_model, requests, batch_size))
    if "generate_batch" in ns.hf_baselines:
        baselines.append(run_generate_batch(hf_model, requests, step_tokens))
    for baseline in baselines:
        print(baseline.line())
    summary: dict[str, Any] = {"stepahead": ours.to_dict(), "transformers": [baseline.to_dict() for baseline in baselines],
               "ratios": {baseline.name: ours.output_tok_s / baseline.output_tok_s for baseline in baselines}}
    for name, ratio in summary["ratios"].items():
        print(f"stepahead / {name}: {ratio:.2f}x")
    return {"runs": [ours], "summary": summary}


# -- command line ---------------------------------------------------------------------------------------


def _range(text: str) -> tuple[int, int]:
    """'100:1024' or '128' -> (min, max)."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def add_workload_args(parser: argparse.ArgumentParser, num_prompts: int, input_len: str, output_len: str) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=num_prompts, help="sequences (default: %(default)s)")
    g.add_argument("--input-len", type=_range, default=_range(input_len), metavar="MIN:MAX",
                   help=f"prompt length range in tokens, uniform (default: {input_len})")
    g.add_argument("--output-len", type=_range, default=_range(output_len), metavar="MIN:MAX",
                   help=f"output length range in tokens, uniform (default: {output_len})")
    g.add_argument("--dataset", choices=["random", "copy"], default="random",
                   help="random token ids, or copy: prompts whose answers copy from them (bench/copy_dataset.py)")
    g.add_argument("--dataset-path", default=None, metavar="FILE.jsonl",
                   help="prompts from JSONL ({\"prompt\" | \"prompt_token_ids\", \"output_len\"?} a line; "
                        "output_len defaults to the --output-len maximum) instead of random token ids")
    g.add_argument("--temperature", type=float, default=0.6, help="(default: %(default)s, as nano-vllm's bench)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate every requested token (default: on); --no-ignore-eos lets EOS finish requests")
    g.add_argument("--progress", action="store_true", help="show a progress bar")


def add_output_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("output")
    g.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")
    # Replaces the engine's --trace switch on bench commands (bench/cli.py excludes it).
    g.add_argument("--trace", dest="trace_file", default=None, metavar="FILE.json",
                   help="write a Chrome/Perfetto trace (engine and worker lanes) of the last run of each mode")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="draw a two-lane timeline, sync above async")
    g.add_argument("--plot-steps", type=int, default=8, help="steady-state steps in the plot (default: %(default)s)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, num_prompts=64, input_len="32:256", output_len="32:256")
    g = parser.add_argument_group("comparison")
    g.add_argument("--compare", choices=["sync", "nospec", "spec", "transformers"], default=None,
                   help="sync: async vs sync scheduler, alternating; nospec: --speculative-config vs without it, "
                        "alternating; spec: --speculative-config vs --baseline-speculative-config, alternating; "
                        "transformers: generate and generate_batch")
    g.add_argument("--baseline-speculative-config", default=None, metavar="JSON",
                   help="--compare spec: the speculative config measured against")
    g.add_argument("--rounds", type=int, default=3, help="rounds of --compare sync (default: %(default)s)")
    g.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="--compare sync: start no round that would end past this many seconds of rounds")
    g.add_argument("--hf-baselines", nargs="+", choices=["generate", "generate_batch"],
                   default=["generate", "generate_batch"],
                   help="transformers paths --compare transformers runs (default: both)")
    g.add_argument("--hf-batch-size", type=int, default=None,
                   help="static batch size of transformers generate (default: min(max-num-seqs, num-prompts))")
    add_output_args(parser)


def emit_outputs(ns, kind: str, engine_args: EngineArgs, result: dict) -> None:
    """--json, --trace and --plot from a result's runs (the last run of each label)."""
    last: dict[str, RunResult] = {}
    for run in result["runs"]:
        last[run.label] = run
    # Sync above async, so the idle gaps sit right over the solid lane.
    timelines = [(label, run.events) for label, run in sorted(last.items(), key=lambda item: "async" in item[0])
                 if run.events]
    if timelines:
        from stepahead.bench.trace import worker_gaps

        result["summary"]["worker_gaps"] = {}
        for label, events in timelines:
            gaps = worker_gaps(events)
            result["summary"]["worker_gaps"][label] = gaps
            shown = ", ".join(f"{transition} {figures['median_ms']:.2f}"
                              for transition, figures in sorted(gaps.items()) if figures["count"] > 1)
            print(f"worker idle gaps in the last {label} run, median ms: {shown}")
    if ns.trace_file and timelines:
        from stepahead.engine.chrome_trace import write_trace

        print(f"trace: {write_trace(ns.trace_file, timelines)}")
    if ns.plot and timelines:
        from stepahead.bench.plot import plot_timelines

        titled = [(last[label].plot_label(), events) for label, events in timelines]
        print(f"plot: {plot_timelines(titled, ns.plot, ns.plot_steps, title=f'stepahead bench {kind}')}")
    if ns.json:
        payload = {"benchmark": kind, "date": now_utc(), "command": command_line(), "machine": machine_info(),
                   "engine_args": engine_args_dict(engine_args), "workload": _workload_dict(ns),
                   "runs": [run.to_dict() for run in result["runs"]], "summary": result["summary"]}
        print(f"json: {write_json(ns.json, payload)}")


def _workload_dict(ns) -> dict:
    keys = ("num_prompts", "dataset", "dataset_path", "input_len", "output_len", "temperature", "ignore_eos", "seed", "compare",
            "rounds", "baseline_speculative_config")
    return {key: getattr(ns, key) for key in keys if hasattr(ns, key)}


def main(ns: argparse.Namespace) -> int:
    from stepahead.entrypoints.engine_flags import engine_args_from_namespace

    if ns.rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {ns.rounds}")
    if ns.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {ns.num_prompts}")
    engine_args = engine_args_from_namespace(ns)
    tracing = bool(ns.trace_file or ns.plot)
    if ns.compare == "sync":
        result = run_compare_sync(ns, engine_args, tracing)
    elif ns.compare == "nospec":
        result = run_compare_nospec(ns, engine_args, tracing)
    elif ns.compare == "spec":
        result = run_compare_spec(ns, engine_args, tracing)
    elif ns.compare == "transformers":
        result = run_compare_transformers(ns, engine_args, tracing)
    else:
        result = run_single(ns, engine_args, tracing)
    emit_outputs(ns, "throughput", engine_args, result)
    return 0
