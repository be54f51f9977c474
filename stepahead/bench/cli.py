"""`stepahead bench serve|throughput|latency|structured`, registered by stepahead.entrypoints.cli."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    from stepahead.entrypoints.engine_flags import add_engine_args

    bench = subparsers.add_parser("bench", help="benchmarks: serve (HTTP load), throughput (offline), latency, structured (grammar cost)")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")

    from stepahead.bench import latency, serve, structured, throughput

    serve_p = sub.add_parser("serve", help="load an OpenAI-compatible server and report vLLM's serving metrics")
    serve.add_arguments(serve_p)
    serve_p.set_defaults(func=serve.main)

    # These take --trace FILE.json (add_output_args) in place of the engine's --trace switch.
    for name, module, text in (
        ("throughput", throughput, "offline throughput on nano-vllm's protocol; --compare sync|transformers"),
        ("latency", latency, "one batch end to end and the per-step latency distribution"),
        ("structured", structured, "JSON-schema requests against the same requests unconstrained, async and sync"),
    ):
        p = sub.add_parser(name, help=text)
        add_engine_args(p, positional_model=False, exclude={"trace"})
        module.add_arguments(p)
        p.set_defaults(func=module.main)
    return bench
