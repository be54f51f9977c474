"""AsyncModelRunnerOutput: a step's result whose sampled ids are still on their way from the GPU.

With async outputs (on CUDA), sample_tokens does not wait for the GPU: it starts non-blocking copies
of the sampled ids and logprobs into pinned host memory, records an event, appends -1 to each
sampling request's token list, and returns this handle. The executor resolves it off the worker's
call path (it waits on the event in a thread of its own), so the worker is already launching step
N+1 while step N's ids travel to the host. Resolving writes the real ids over the -1s it was given
and builds the ModelRunnerOutput; it is idempotent and thread-safe, so the runner may also resolve
a handle itself when it needs the ids (penalties read every earlier output).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stepahead.core.sched_output import ModelRunnerOutput
from stepahead.worker.sampler import SamplerOutput


def copy_to_host(sampled: SamplerOutput) -> SamplerOutput:
    """Start non-blocking copies of every tensor of `sampled` into fresh host memory (pinned on CUDA)."""
    def copy(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t.clone()
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

    def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else copy(t)

    return SamplerOutput(copy(sampled.sampled_token_ids), to_host(sampled.sampled_logprobs),
                         to_host(sampled.sampled_ranks), to_host(sampled.top_token_ids),
                         to_host(sampled.top_logprobs))


@dataclass
class AsyncModelRunnerOutput:
    host: SamplerOutput  # host copies, complete once `ready` has passed
    ready: torch.cuda.Event | None  # None when the copies were synchronous (CPU)
    placeholders: list[tuple[list[int], int]]  # (a sampling row's token list, index of its -1), in row order
    finish: Callable[[list[int], SamplerOutput], ModelRunnerOutput]  # builds the output on the host
    gpu_timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # (start, end) of the step's GPU work
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _output: ModelRunnerOutput | None = None

    @property
    def resolved(self) -> bool:
        return self._output is not None

    def get_output(self) -> ModelRunnerOutput:
        with self._lock:
            if self._output is None:
                self._output = self._resolve()
            return self._output

    def _resolve(self) -> ModelRunnerOutput:
        if self.ready is not None:
            self.ready.synchronize()
        sampled = self.host.sampled_token_ids.tolist()
        for (tokens, index), token in zip(self.placeholders, sampled, strict=True):
            tokens[index] = token
        out = self.finish(sampled, self.host)
        if self.gpu_timing is not None:
            start, end = self.gpu_timing
            out.gpu_busy_s = start.elapsed_time(end) / 1000.0
        return out
