"""`stepahead simulate`: one request traced through the real scheduler and EngineCore loop.

One request goes through the engine with a scripted model (no torch, no weights). Every schedule
and every processed output is printed with the scheduler's counters, and the forward passes wasted
on an already-finished request are counted at the end (docs/design.md, "EOS waste"). With the
defaults, a 6-token prompt and a budget of 4 tokens, the printout shows placeholders rising when a
step is scheduled and falling when its token arrives.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from stepahead.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from stepahead.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from stepahead.engine.core import EngineCore
from stepahead.request import Request
from stepahead.sampling_params import SamplingParams
from stepahead.tools.scripted_worker import ScriptedExecutor, ScriptedModel
from stepahead.utils import cdiv

RID = "r0"
EOS = 2


class _TracingEngineCore(EngineCore):
    """EngineCore that narrates each schedule and each processed output of one request."""

    def __init__(self, config: EngineConfig, executor: ScriptedExecutor, out: TextIO, request: Request) -> None:
        super().__init__(config, executor)
        self.out = out
        self.request = request
        self.num_out = 0

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = super()._schedule()
        step_id = scheduler_output.step_id
        num_scheduled = scheduler_output.num_scheduled_tokens.get(RID)
        req = self.scheduler.requests.get(RID)
        if num_scheduled and req is not None:
            self.out.write(f"  schedule step {step_id}: {num_scheduled} token(s)  -> "
                           f"computed={req.num_computed_tokens} known={req.num_tokens} "
                           f"placeholders={req.num_output_placeholders}\n")
        elif req is not None:
            self.out.write(f"  schedule step {step_id}: nothing for {RID} (the steps in flight reach max_tokens)\n")
        return scheduler_output

    def _update(self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        step_id = scheduler_output.step_id
        num_scheduled = scheduler_output.num_scheduled_tokens.get(RID)
        finished_before = RID not in self.scheduler.requests
        outputs = super()._update(scheduler_output, model_output)
        if not num_scheduled:
            return outputs
        if finished_before:
            self.out.write(f"  output   step {step_id}: request already finished, result discarded\n")
            return outputs
        mine = [o for o in outputs if o.request_id == RID]
        if not mine:
            self.out.write(f"  output   step {step_id}: prefill chunk, nothing sampled\n")
            return outputs
        output = mine[0]
        req = self.request  # still readable after it finished: the last counters are printed too
        self.num_out += len(output.new_token_ids)
        what = f"token {self.num_out}"
        if output.finish_reason == "stop":
            what += " = EOS, finished (stop)"
        elif output.finish_reason == "length":
            what += ", finished (length)"
        self.out.write(f"  output   step {step_id}: {what}  -> known={req.num_tokens} "
                       f"placeholders={req.num_output_placeholders}\n")
        return outputs


def simulate(prompt_len: int, max_num_batched_tokens: int, max_tokens: int, eos_at: int = 0,
             depth: int | None = None, async_scheduling: bool = True, out: TextIO | None = None) -> int:
    """Run one request to completion, narrating to `out`; returns the wasted forward passes."""
    out = out or sys.stdout
    depth = depth or (2 if async_scheduling else 1)
    block_size = 16
    max_model_len = prompt_len + max_tokens + 1
    num_blocks = cdiv(max_model_len, block_size) + 2
    config = EngineConfig(
        model_config=ModelConfig(model="scripted", architecture="Scripted", hf_config={}, dtype="float32",
                                 max_model_len=max_model_len, vocab_size=1000, num_layers=1, num_kv_heads=1,
                                 head_dim=1, eos_token_id=EOS),
        scheduler_config=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=max_model_len),
        cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        async_scheduling=async_scheduling, max_concurrent_batches=depth, executor="uni", device="cpu",
    )
    executor = ScriptedExecutor(ScriptedModel(eos_token_id=EOS, eos_at={RID: eos_at}), block_size, num_blocks)
    request = Request(RID, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens),
                      eos_token_id=EOS)
    core = _TracingEngineCore(config, executor, out, request)
    try:
        core.add_request(request)
        while core.has_work():
            core.step()
    finally:
        core.shutdown()
    wasted = core.get_stats().wasted_request_steps
    out.write(f"  wasted forward passes for this request: {wasted}\n")
    return wasted


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="trace one request through the scheduler with a scripted model",
                              description=__doc__)
    p.add_argument("--prompt-len", type=int, default=6, help="prompt tokens (default 6)")
    p.add_argument("--max-num-batched-tokens", type=int, default=4, help="token budget per step (default 4)")
    p.add_argument("--max-tokens", type=int, default=3, help="output token cap (default 3)")
    p.add_argument("--eos-at", type=int, default=0, help="1-based output position of EOS; 0 = never")
    p.add_argument("--depth", type=int, default=None,
                   help="batch-queue depth, max_concurrent_batches (default 2 with async, 1 without)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    for name in ("prompt_len", "max_num_batched_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eos_at < 0 or (args.depth is not None and args.depth < 1):
        raise SystemExit("--eos-at must be >= 0 and --depth >= 1")
    simulate(args.prompt_len, args.max_num_batched_tokens, args.max_tokens, args.eos_at, args.depth,
             args.async_scheduling)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stepahead")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
