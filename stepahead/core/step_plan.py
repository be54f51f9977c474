"""One scheduling step's decisions (StepPlan) and the SchedulerOutput the worker receives for them.

The scheduler fills a StepPlan while it walks the running and waiting requests; make_scheduler_output
turns the plan into the plain-data contract of sched_output.py: new requests in full, the others as
diffs against what the worker already holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stepahead.core.kv_cache import KVCacheManager
from stepahead.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from stepahead.request import Request


@dataclass
class StepPlan:
    max_num_scheduled_tokens: int
    token_budget: int  # tokens the step may still schedule
    num_scheduled: dict[str, int] = field(default_factory=dict)
    # Blocks added to each request scheduled from running (None: no new block).
    new_blocks_of: dict[str, list[int] | None] = field(default_factory=dict)
    running: list[Request] = field(default_factory=list)  # were running, scheduled again
    new: list[Request] = field(default_factory=list)  # admitted for the first time
    resumed: list[Request] = field(default_factory=list)  # admitted again after a preemption
    preempted: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts scheduled per request

    @classmethod
    def with_budget(cls, max_num_scheduled_tokens: int) -> StepPlan:
        return cls(max_num_scheduled_tokens, max_num_scheduled_tokens)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return self.max_num_scheduled_tokens - self.token_budget

    def schedule(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        self.token_budget -= num_tokens


def make_scheduler_output(plan: StepPlan, kv: KVCacheManager, prev_step_req_ids: set[str],
                          finished_req_ids: set[str], preempted_req_ids: set[str], step_id: int) -> SchedulerOutput:
    """Called before the scheduled tokens are counted as computed: the worker gets the pre-step counts."""
    new_reqs_data = [
        NewRequestData(r.request_id, r.prompt_token_ids, r.sampling_params,
                       kv.get_block_ids(r.request_id), r.num_computed_tokens)
        for r in plan.new
    ]
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs_data,
        scheduled_cached_reqs=_cached_request_data(plan, kv, prev_step_req_ids),
        num_scheduled_tokens=plan.num_scheduled,
        total_num_scheduled_tokens=plan.total_num_scheduled_tokens,
        finished_req_ids=finished_req_ids,
        preempted_req_ids=preempted_req_ids,
        step_id=step_id,
        scheduled_spec_decode_tokens=plan.spec_tokens,
    )


def _cached_request_data(plan: StepPlan, kv: KVCacheManager, prev_step_req_ids: set[str]) -> CachedRequestData:
    """Running and resumed requests as diffs; num_output_tokens counts real outputs plus placeholders."""
    data = CachedRequestData()
    for req in plan.running:
        rid = req.request_id
        data.req_ids.append(rid)
        if rid not in prev_step_req_ids:  # the worker may have dropped it from its batch
            data.all_token_ids[rid] = list(req.all_token_ids)
        data.new_block_ids.append(plan.new_blocks_of[rid])
        data.num_computed_tokens.append(req.num_computed_tokens)
        data.num_output_tokens.append(req.num_output_tokens + req.num_output_placeholders)
    for req in plan.resumed:
        rid = req.request_id
        data.req_ids.append(rid)
        data.resumed_req_ids.add(rid)
        data.all_token_ids[rid] = list(req.all_token_ids)
        data.new_block_ids.append(kv.get_block_ids(rid))  # replaces the table
        data.num_computed_tokens.append(req.num_computed_tokens)
        data.num_output_tokens.append(req.num_output_tokens + req.num_output_placeholders)
    return data
