"""Every EngineArgs field as a command-line flag, with vLLM's spelling (--max-num-seqs, ...).

Generated from the dataclass, so a new EngineArgs field becomes a flag of every subcommand
(generate, chat, serve, bench) without touching this file.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Collection
from dataclasses import MISSING, fields
from typing import Any

from stepahead.config import CHOICES, EngineArgs

_HELP = {
    "dtype": "weights and activations dtype ('auto': chosen from the checkpoint and the device)",
    "seed": "random seed for dummy weights and unseeded sampling",
    "max_model_len": "context length (default: the model's)",
    "max_num_seqs": "most requests in one batch",
    "max_num_batched_tokens": "most tokens in one step (default: 2048, or max_model_len without chunked prefill)",
    "block_size": "tokens per KV-cache block",
    "num_kv_blocks": "KV pool size in blocks, overriding the memory budget",
    "kv_cache_memory_bytes": "KV pool budget in bytes",
    "enable_prefix_caching": "reuse KV blocks of identical prompt prefixes",
    "enable_chunked_prefill": "split long prompts across steps",
    "async_scheduling": "schedule step N+1 while step N runs (default: auto, on)",
    "max_concurrent_batches": "steps in flight (default: 2 with async scheduling, 1 without)",
    "executor": "'mp': worker in a separate process; 'uni': worker thread in the engine process",
    "load_format": "'dummy': random weights of the model's shape",
    "device": "where the model runs",
    "num_threads": "torch threads in the worker (default: chosen by the executor)",
    "served_model_name": "model name reported by the API",
    "tokenizer": "folder holding the tokenizer (default: the model's)",
    "debug_invariants": "check scheduler invariants after every step (slow)",
    "defer_block_free": "park freed KV blocks until every in-flight step is processed",
    "trace": "record a timeline trace of engine and worker events",
}
_SKIP = {"model", "extra"}


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = True,
                    exclude: Collection[str] = ()) -> argparse.ArgumentParser:
    """Add the model (positional when asked, and --model) and one flag per EngineArgs field.

    exclude: fields a subcommand gives a flag of its own (serve and bench take --trace FILE); those
    fields keep their EngineArgs default.
    """
    group = parser.add_argument_group("engine")
    if positional_model:
        group.add_argument("model", nargs="?", default=None,
                           help="model folder or .gguf file (default: the built-in SmolLM2-135M-Instruct)")
    group.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                       help="model folder or .gguf file (default: the built-in SmolLM2-135M-Instruct)")
    hints = typing.get_type_hints(EngineArgs)
    for f in fields(EngineArgs):
        if f.name in _SKIP or f.name in exclude:
            continue
        default = f.default if f.default is not MISSING else None
        kind = _base_type(hints[f.name])
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": _HELP.get(f.name, "")}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind if kind in (int, float) else str
            if f.name in CHOICES:
                kwargs["choices"] = CHOICES[f.name]
        if default is not None:
            kwargs["help"] += " (default: %(default)s)"
        group.add_argument(flag_name(f.name), **kwargs)
    return parser


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    values = {name: getattr(ns, name) for name in EngineArgs.field_names() if name != "model" and hasattr(ns, name)}
    positional, flag = getattr(ns, "model", None), getattr(ns, "model_flag", None)
    if positional and flag and positional != flag:
        raise ValueError(f"model given twice: {positional!r} and --model {flag!r}")
    return EngineArgs(model=positional or flag, **values)


def _base_type(hint: Any) -> Any:
    """int for `int | None`, bool for `bool`, ..."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint
