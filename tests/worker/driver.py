"""A minimal scheduler stand-in that drives ModelRunner with hand-built SchedulerOutputs.

It allocates blocks from a counter, chunks prefills, can reuse another request's blocks as a
prefix-cache hit and can preempt/resume a request, sending exactly the diffs the real scheduler sends.
With async outputs (the CUDA default) it resolves each step's handle at once, as the sync engine reads ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stepahead.config import EngineConfig
from stepahead.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from stepahead.engine.arg_utils import EngineArgs
from stepahead.sampling_params import SamplingParams
from stepahead.worker.async_output import AsyncModelRunnerOutput


def make_config(model, block_size=16, num_blocks=256, max_num_batched_tokens=512, device="cpu",
                max_num_seqs=64, **kw) -> EngineConfig:
    args = EngineArgs(model=str(model), block_size=block_size, num_kv_blocks=num_blocks, executor="uni",
                      device=device, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                      **kw)
    return args.create_engine_config()


@dataclass
class Req:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    max_new: int
    outputs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    known_to_worker: bool = False
    resumed: bool = False
    prefix_blocks: list[int] = field(default_factory=list)  # a cache hit to claim at admission

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.max_new


class MiniSched:
    def __init__(self, runner, block_size: int, chunk: int = 10**9) -> None:
        self.runner, self.bs, self.chunk = runner, block_size, chunk
        self.next_block = 1
        self.reqs: dict[str, Req] = {}
        self.finished: set[str] = set()
        self.steps = 0

    def add(self, req_id, prompt, max_new, params=None, prefix_blocks=None) -> Req:
        r = Req(req_id, list(prompt), params or SamplingParams(temperature=0.0, max_tokens=max_new), max_new,
                prefix_blocks=list(prefix_blocks or []))
        self.reqs[req_id] = r
        return r

    def _alloc(self, r: Req, upto: int) -> list[int]:
        new = []
        while len(r.blocks) * self.bs < upto:
            r.blocks.append(self.next_block)
            new.append(self.next_block)
            self.next_block += 1
        return new

    def preempt(self, req_id: str) -> None:
        r = self.reqs[req_id]
        r.blocks, r.computed, r.resumed = [], 0, True

    def step(self, only: set[str] | None = None):
        out = self.runner.execute_model(self.build(only))
        if out is None:
            out = self.runner.sample_tokens(None)
        if isinstance(out, AsyncModelRunnerOutput):
            out = out.get_output()
        self.steps += 1
        for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
            r = self.reqs[rid]
            r.outputs.extend(toks)
            if r.done:
                self.finished.add(rid)
        return out

    def build(self, only: set[str] | None = None) -> SchedulerOutput:
        """The next step's SchedulerOutput (the requests' state advances as if it ran)."""
        new_reqs, cd, nsched = [], CachedRequestData(), {}
        for r in self.reqs.values():
            if r.done or (only is not None and r.req_id not in only):
                continue
            if not r.known_to_worker and r.prefix_blocks:
                r.blocks = list(r.prefix_blocks)
                r.computed = len(r.blocks) * self.bs
            n = min(self.chunk, len(r.tokens) - r.computed)
            start = r.computed
            new_blocks = self._alloc(r, start + n)
            if not r.known_to_worker:
                new_reqs.append(NewRequestData(r.req_id, r.prompt, r.params, list(r.blocks), start))
                r.known_to_worker = True
            else:
                cd.req_ids.append(r.req_id)
                cd.num_computed_tokens.append(start)
                cd.num_output_tokens.append(len(r.outputs))
                if r.resumed:
                    cd.resumed_req_ids.add(r.req_id)
                    cd.all_token_ids[r.req_id] = list(r.tokens)
                    cd.new_block_ids.append(list(r.blocks))
                    r.resumed = False
                else:
                    cd.new_block_ids.append(new_blocks or None)
            nsched[r.req_id] = n
            r.computed += n
        so = SchedulerOutput(new_reqs, cd, nsched, sum(nsched.values()), self.finished)
        self.finished = set()
        return so

    def run(self, max_steps: int = 1000) -> dict[str, list[int]]:
        while not all(r.done for r in self.reqs.values()):
            self.step()
            assert self.steps < max_steps
        return {rid: r.outputs for rid, r in self.reqs.items()}
