"""What every benchmark result file carries besides its figures: the command, the date, the machine."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np


class TokenRates:
    """Token throughput of a timed run; mixed into result dataclasses with these three fields."""

    elapsed_s: float
    prompt_tokens: int
    output_tokens: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "processor": _cpu_model()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def command_line() -> str:
    return "stepahead " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def engine_args_dict(engine_args) -> dict:
    return {f.name: getattr(engine_args, f.name) for f in fields(engine_args) if f.name != "extra"}


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_jsonable))
    return path


def _jsonable(obj):
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def distribution_ms(values_s: list[float], percentiles=(50, 90, 99)) -> dict:
    """mean / median / std / percentiles in milliseconds of a list of seconds (zeros when empty)."""
    if not values_s:
        return {"count": 0, "mean_ms": 0.0, "median_ms": 0.0, "std_ms": 0.0,
                **{f"p{percent}_ms": 0.0 for percent in percentiles}}
    values_ms = np.asarray(values_s, dtype=np.float64) * 1e3
    figures = {"count": int(values_ms.size), "mean_ms": float(values_ms.mean()),
               "median_ms": float(np.median(values_ms)), "std_ms": float(values_ms.std())}
    figures.update({f"p{percent}_ms": float(np.percentile(values_ms, percent)) for percent in percentiles})
    return figures
