"""AsyncScheduler: schedules step N+1 before step N's output is known (the seed's mechanism).

Exactly two hooks differ from the synchronous Scheduler: after scheduling, every request that will
sample gets a placeholder for the token it is about to produce; when the real token arrives, the
placeholder is redeemed and the prefix cache advances to the real-token frontier comp - ph.
"""

from __future__ import annotations

from stepahead.core.sched_output import SchedulerOutput
from stepahead.core.scheduler import Scheduler
from stepahead.request import Request, RequestStatus


class AsyncScheduler(Scheduler):
    num_sampled_tokens_per_step = 1

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        super()._update_after_schedule(scheduler_output)
        requests = self.requests
        spec = scheduler_output.scheduled_spec_decode_tokens
        pending = False
        for rid in scheduler_output.num_scheduled_tokens:
            req = requests[rid]
            if req.is_prefill_chunk:
                continue  # nothing is sampled by a chunk that stops short of the known tokens
            # The grammar has not seen the in-flight token yet: sampling must wait (seed, §2.8).
            if req.use_structured_output and req.num_output_placeholders > 0:
                pending = True
            drafts = spec.get(rid)
            req.num_output_placeholders += self.num_sampled_tokens_per_step + (len(drafts) if drafts else 0)
        scheduler_output.pending_structured_output_tokens |= pending

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int], is_stale: bool = False
    ) -> tuple[list[int], bool]:
        status_before = request.status
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids, is_stale)
        # Placeholders were zeroed at preemption; a stale delivery must not decrement them.
        if not is_stale:
            request.num_output_placeholders -= len(new_token_ids)
            assert request.num_output_placeholders >= 0, request
        if status_before == RequestStatus.RUNNING:
            # Only blocks whose every token is real may be hashed.
            self.kv_cache_manager.cache_blocks(
                request, request.num_computed_tokens - request.num_output_placeholders)
        return new_token_ids, stopped
