"""`stepahead bench latency --breakdown`: where a worker step's time goes on CPU.

Timers hooked onto the model while the benchmark runs (the worker must be in this process: the
latency benchmark switches to the uni executor for it), summed per category and divided by the
number of worker steps:

- matmul: the projections (every leaf module whose class name ends in "Linear", dense or packed);
- attention: the attention modules minus their projections (RoPE, SDPA), with KV write (the new
  tokens' K/V stored at their slots) and KV gather (the blocks copied out for SDPA) apart;
- other layers: the rest of the forward pass (embedding, norms, SiLU, residual adds);
- output head: compute_logits; sampler: the sample phase minus the head;
- host: the rest of the worker step (input preparation, Python between kernels, messages).

The hooks cost a few microseconds each (about 6 per layer per step), which the host share absorbs.
DecodeStack (a packed model's decode-only step in one C++ call, kernels/cpu_decode_stack.py) is off
while timed: hooks cannot see into it, so the breakdown shows the same arithmetic through the layers,
with the Python the stack saves.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import nn

CATEGORIES = ("matmul", "attention", "kv_write", "kv_gather", "other_layers", "output_head", "sampler", "host")


@dataclass
class Timers:
    """Seconds per category, measured on the worker thread."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _local: threading.local = field(default_factory=threading.local)

    def push(self) -> None:
        stack = getattr(self._local, "starts", None)
        if stack is None:
            stack = self._local.starts = []
            self._local.in_attention = False
        stack.append(time.perf_counter())

    def pop(self, category: str) -> None:
        elapsed = time.perf_counter() - self._local.starts.pop()
        self.seconds[category] += elapsed
        if category == "linear" and self._local.in_attention:
            self.seconds["attention_linear"] += elapsed

    def set_in_attention(self, value: bool) -> None:
        self._local.in_attention = value


def _category(module: nn.Module) -> str | None:
    name = type(module).__name__
    if name.endswith("Linear"):
        return "linear"
    if name == "Attention":
        return "attention_module"
    if name.endswith("ForCausalLM"):
        return "model"
    return None


@contextlib.contextmanager
def hooked(timers: Timers) -> Iterator[None]:
    """Time the model's modules and the attention layer's KV copies while the context is open."""
    from stepahead.attention import sdpa
    from stepahead.models.llama import LlamaForCausalLM

    def pre(module, args):
        category = _category(module)
        if category is not None:
            timers.push()
            if category == "attention_module":
                timers.set_in_attention(True)

    def post(module, args, output):
        category = _category(module)
        if category is not None:
            if category == "attention_module":
                timers.set_in_attention(False)
            timers.pop(category)

    def timed(fn, category):
        def wrapper(*args, **kwargs):
            timers.push()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.pop(category)
        return wrapper

    saved = {"write_kv": sdpa.write_kv, "_gather": sdpa._gather}
    saved_logits = LlamaForCausalLM.compute_logits
    saved_group = sdpa.AttentionMetadata.single_decode_group
    sdpa.AttentionMetadata.single_decode_group = lambda self: None  # type: ignore[method-assign]  # every step through the layers
    handles = [nn.modules.module.register_module_forward_pre_hook(pre),
               nn.modules.module.register_module_forward_hook(post)]
    # Patching module functions and methods for the duration of the run is the point here.
    sdpa.write_kv = timed(saved["write_kv"], "kv_write")  # type: ignore[assignment]
    sdpa._gather = timed(saved["_gather"], "kv_gather")  # type: ignore[assignment]
    LlamaForCausalLM.compute_logits = timed(saved_logits, "output_head")  # type: ignore[method-assign]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        sdpa.write_kv, sdpa._gather = saved["write_kv"], saved["_gather"]  # type: ignore[assignment]
        LlamaForCausalLM.compute_logits = saved_logits  # type: ignore[method-assign]
        sdpa.AttentionMetadata.single_decode_group = saved_group  # type: ignore[method-assign]


def split(timers: Timers, step_s: float, sample_s: float, num_steps: int) -> dict[str, float]:
    """Milliseconds per step by category (CATEGORIES), from the hooked totals and the trace's
    worker step and sample-phase totals."""
    s = timers.seconds
    attention_core = s["attention_module"] - s["attention_linear"]
    parts = {
        "matmul": s["linear"],
        "attention": max(attention_core - s["kv_write"] - s["kv_gather"], 0.0),
        "kv_write": s["kv_write"],
        "kv_gather": s["kv_gather"],
        "other_layers": max(s["model"] - s["attention_module"] - (s["linear"] - s["attention_linear"]), 0.0),
        "output_head": s["output_head"],
        "sampler": max(sample_s - s["output_head"], 0.0),
        "host": max(step_s - s["model"] - sample_s, 0.0),
    }
    return {name: 1e3 * parts[name] / max(num_steps, 1) for name in CATEGORIES}
