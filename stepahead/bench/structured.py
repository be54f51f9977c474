"""`stepahead bench structured`: what grammars cost. N JSON-schema requests against the same N
prompts unconstrained, with the same number of output tokens each (the unconstrained run takes each
request's structured output length as its max_tokens, with ignore_eos), async and sync alternately,
each engine kept alive across rounds.

Reports output tok/s per mode and kind, the structured / unconstrained ratio per mode, async / sync,
and the grammar's cost per step from the trace: the engine's bitmask fill and the worker's apply, ms.
"""

from __future__ import annotations

import argparse
import statistics

from stepahead.bench.datasets import SampleRequest
from stepahead.bench.report import command_line, engine_args_dict, machine_info, now_utc, write_json
from stepahead.bench.throughput import RunResult, make_llm, run_once, warm_up
from stepahead.engine.arg_utils import EngineArgs

# What a JSON-mode client asks for: records with typed, bounded fields.
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "city"]},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "year": {"type": "integer"},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action", "horror"]}, "maxItems": 3}},
     "required": ["title", "year", "genres"]},
    {"type": "object", "properties": {
        "product": {"type": "string", "maxLength": 32}, "price": {"type": "number", "minimum": 0},
        "in_stock": {"type": "boolean"}}, "required": ["product", "price", "in_stock"]},
    {"type": "object", "properties": {
        "event": {"type": "string", "maxLength": 32}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4}},
     "required": ["event", "date", "attendees"]},
]
ASKS = ["a person", "a film", "a product", "an event"]


def _requests(llm, num_prompts: int) -> tuple[list[SampleRequest], list[dict]]:
    tokenizer = llm.get_tokenizer()
    requests, schemas = [], []
    for i in range(num_prompts):
        kind = i % len(SCHEMAS)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe {ASKS[kind]} (number {i}) as a JSON object."}],
            tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        requests.append(SampleRequest(ids, len(ids), 0))
        schemas.append(SCHEMAS[kind])
    return requests, schemas


def _grammar_ms_per_step(run: RunResult) -> dict:
    """Mean ms per step of the engine's bitmask fill and the worker's apply (trace events)."""
    out = {}
    for name, key in (("grammar_bitmask", "fill_ms_per_step"), ("apply_bitmask", "apply_ms_per_step")):
        durations = [e.end - e.start for e in run.events if e.name == name]
        out[key] = 1e3 * statistics.fmean(durations) if durations else 0.0
    return out


def run(ns, engine_args: EngineArgs) -> dict:
    from stepahead.sampling_params import SamplingParams, StructuredOutputsParams

    engines = {"async": make_llm(engine_args, True, True)}
    try:
        engines["sync"] = make_llm(engine_args, False, True)
        requests, schemas = _requests(engines["async"], ns.num_prompts)
        structured = [SamplingParams(temperature=0.0, max_tokens=ns.max_tokens,
                                     structured_outputs=StructuredOutputsParams(json=schema)) for schema in schemas]
        for llm in engines.values():
            warm_up(llm, requests)
        # Greedy: every mode and round produces these lengths, which the unconstrained runs reproduce.
        outputs = engines["async"].generate([r.engine_prompt() for r in requests], structured, use_tqdm=False)
        plain = [SamplingParams(temperature=0.0, max_tokens=len(o.outputs[0].token_ids), ignore_eos=True)
                 for o in outputs]
        rows = []
        for round_index in range(ns.rounds):
            order = ("async", "sync") if round_index % 2 == 0 else ("sync", "async")
            for mode in order:
                llm = engines[mode]
                constrained = run_once(llm, f"{mode} structured", requests, structured, round_index=round_index + 1)
                free = run_once(llm, f"{mode} unconstrained", requests, plain, round_index=round_index + 1)
                row = {"round": round_index + 1, "mode": mode,
                       "structured_tok_s": constrained.output_tok_s, "unconstrained_tok_s": free.output_tok_s,
                       "ratio": constrained.output_tok_s / free.output_tok_s,
                       "output_tokens": constrained.output_tokens, "stop_finishes": constrained.stop_finishes,
                       **_grammar_ms_per_step(constrained)}
                rows.append(row)
                print(f"round {row['round']} {mode:5s}: structured {row['structured_tok_s']:7.1f} tok/s, "
                      f"unconstrained {row['unconstrained_tok_s']:7.1f} tok/s, ratio {row['ratio']:.3f}; "
                      f"bitmask fill {row['fill_ms_per_step']:.2f} ms + apply {row['apply_ms_per_step']:.2f} ms "
                      f"per step; {row['output_tokens']} tokens, {row['stop_finishes']} stop finishes")
    finally:
        for llm in engines.values():
            llm.shutdown()
    summary = {}
    for mode in ("async", "sync"):
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {key: statistics.median(r[key] for r in mine)
                         for key in ("structured_tok_s", "unconstrained_tok_s", "ratio", "fill_ms_per_step",
                                     "apply_ms_per_step")}
    summary["async_over_sync_structured"] = statistics.median(
        a["structured_tok_s"] / s["structured_tok_s"]
        for a, s in zip([r for r in rows if r["mode"] == "async"], [r for r in rows if r["mode"] == "sync"],
                        strict=True))
    print("medians: " + "; ".join(
        f"{mode} structured/unconstrained {summary[mode]['ratio']:.3f} (fill {summary[mode]['fill_ms_per_step']:.2f} ms"
        f" + apply {summary[mode]['apply_ms_per_step']:.2f} ms per step)" for mode in ("async", "sync"))
        + f"; async/sync structured {summary['async_over_sync_structured']:.3f}")
    return {"rows": rows, "summary": summary}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=64, help="concurrent JSON-schema requests (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=128, help="per request (default: %(default)s)")
    g.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)")
    g.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")


def main(ns: argparse.Namespace) -> int:
    from stepahead.entrypoints.engine_flags import engine_args_from_namespace

    engine_args = engine_args_from_namespace(ns)
    result = run(ns, engine_args)
    if ns.json:
        write_json(ns.json, {"benchmark": "structured", "date": now_utc(), "command": command_line(),
                             "machine": machine_info(), "engine_args": engine_args_dict(engine_args), **result})
    return 0
