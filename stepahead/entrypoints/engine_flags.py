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

from stepahead.engine.arg_utils import CHOICES, EngineArgs

_SKIP = {"model"}


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
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": f.metadata.get("help", "")}
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
