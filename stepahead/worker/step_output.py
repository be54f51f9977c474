"""A step's ModelRunnerOutput, built on the host from its sampled ids: at once, or, with async outputs, by
the executor's resolver thread once the ids have reached the host (async_output.py). Every output
carries the step's busy time, its prompt logprobs and, when tracing, its trace events.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from stepahead.core.sched_output import ModelRunnerOutput
from stepahead.distributed.state import ParallelState
from stepahead.tracing import TraceEvent
from stepahead.worker.async_output import AsyncModelRunnerOutput, copy_to_host
from stepahead.worker.prompt_logprobs import StepPromptLogprobs
from stepahead.worker.request_state import CachedRequestState
from stepahead.worker.row_failures import RowsApart
from stepahead.worker.sampler import SamplerOutput, logprobs_to_host
from stepahead.worker.sampling_metadata import SamplingMetadata


@dataclass
class StepState:
    """What execute_model leaves for sample_tokens."""

    step_id: int
    req_ids: list[str]  # batch order
    sample_rows: list[int]
    hidden: torch.Tensor | None  # [num_sample_rows, hidden]; None on a pipeline stage before the last
    num_tokens: int
    t_start: float
    events: list[TraceEvent]
    gpu_start: torch.cuda.Event | None  # recorded just before the step's upload, its first device work (CUDA)
    prompt_logprobs: StepPromptLogprobs | None = None  # for requests that asked (worker/prompt_logprobs.py)
    sample_drafts: list[list[int]] | None = None  # with speculation: each sampling row's drafts (logits per position)


def trace_args(ps: ParallelState, step_id: int, num_reqs: int, num_tokens: int) -> dict[str, int]:
    """The arguments of a step's trace events; with pipeline stages, the stage (one timeline lane per
    stage, bench/plot.py)."""
    args = {"step": step_id, "num_reqs": num_reqs, "num_tokens": num_tokens}
    if ps.pp_size > 1:
        args["stage"] = ps.pp_rank
    return args


class StepOutputs:
    """Builds the runner's outputs. trace: whether they carry the step's trace events."""

    def __init__(self, trace: bool, ps: ParallelState, device: torch.device) -> None:
        self.trace = trace
        self.ps = ps
        self.device = device

    def build(self, step: StepState, metadata: SamplingMetadata | None, t0: float, t1: float,
              ids: list[int], host: SamplerOutput, apart: RowsApart | None = None) -> ModelRunnerOutput:
        """The step's ModelRunnerOutput from its sampled ids and logprob tensors, both on the host
        (or, when the batch's sampling failed, from its rows sampled one at a time)."""
        row_logprobs = {}
        if apart is not None:
            row_logprobs = apart.logprobs
        elif metadata is not None and metadata.max_num_logprobs is not None:
            row_logprobs = logprobs_to_host(host, metadata, ids)
        sampled_token_ids: list[list[int]] = [[] for _ in step.req_ids]
        logprobs = {}
        for i, b in enumerate(step.sample_rows):
            sampled_token_ids[b] = [ids[i]]
            if i in row_logprobs:
                logprobs[step.req_ids[b]] = [row_logprobs[i]]
        out = ModelRunnerOutput(step.req_ids, sampled_token_ids, logprobs)
        if apart is not None:
            out.failed = {step.req_ids[step.sample_rows[i]]: reason for i, reason in apart.failed.items()}
        return self.account(out, step, t0, t1)

    def deferred(self, step: StepState, metadata: SamplingMetadata | None, t0: float, sampled: SamplerOutput,
                 states: list[CachedRequestState]) -> AsyncModelRunnerOutput:
        """The step's output while its sampled ids are still on their way to the host: each sampling
        request's token list gets a -1 that resolving the handle overwrites."""
        host = copy_to_host(sampled)
        ready = gpu_timing = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event(enable_timing=True, blocking=True)  # the resolver sleeps, not spins
            ready.record()
            gpu_timing = (step.gpu_start, ready)
        placeholders = []
        for state in states:
            placeholders.append((state.token_ids, len(state.token_ids)))
            state.token_ids.append(-1)
        # The output is built on the host once the ids arrive (by the executor's resolver thread).
        finish = functools.partial(self.build, step, metadata, t0, time.monotonic())
        return AsyncModelRunnerOutput(host, ready, placeholders, finish, gpu_timing)

    def account(self, out: ModelRunnerOutput, step: StepState, t0: float, t1: float) -> ModelRunnerOutput:
        """The step's busy time, prompt logprobs and trace events on its output."""
        # On CPU the host does the device's work: its time is the device time too (CUDA overrides it).
        out.busy_s = out.gpu_busy_s = t1 - step.t_start
        if step.prompt_logprobs is not None:
            out.prompt_logprobs = step.prompt_logprobs.to_host()
        if self.trace:
            args = trace_args(self.ps, step.step_id, len(step.req_ids), step.num_tokens)
            out.trace_events = step.events + [TraceEvent("sample", "worker", t0, t1, args)]
        return out

    @staticmethod
    def time_on_device(out: ModelRunnerOutput, step: StepState) -> ModelRunnerOutput:
        """On CUDA, the device time of a step whose ids were read synchronously, from its events."""
        if step.gpu_start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            out.gpu_busy_s = step.gpu_start.elapsed_time(end) / 1000.0
        return out
