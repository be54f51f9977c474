"""AsyncScheduler: schedules step N+1 before step N's output is known.

Exactly two hooks differ from the synchronous Scheduler: after scheduling, every request that will
sample gets a placeholder for the token it is about to produce; when the real token arrives, the
placeholder is redeemed and the prefix cache advances to the real-token frontier
num_computed_tokens - num_output_placeholders (docs/design.md, "Placeholders" and "The cacheable
frontier").
"""

from __future__ import annotations

from stepahead.core.sched_output import SchedulerOutput
from stepahead.core.scheduler import Scheduler
from stepahead.request import Request, RequestStatus


class AsyncScheduler(Scheduler):
    """A Scheduler that runs one or more steps ahead of the model's outputs.

    Owns nothing beyond the base class; it adds the placeholder bookkeeping. Guarantees, on top of
    the base ones: for a running request that is not a prefill chunk,
    num_tokens + num_output_placeholders == num_computed_tokens + 1 (I3); only blocks whose every
    token is real are hashed (I5); a request is never scheduled past max_tokens (docs/design.md,
    "The max_tokens guard"); a step whose grammar has not seen an in-flight token is flagged so its
    sampling waits (docs/design.md, "Deferred sampling for grammars").
    """

    uses_placeholders = True
    num_sampled_tokens_per_step = 1

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        super()._update_after_schedule(scheduler_output)
        requests = self.requests
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        num_spec = self.num_spec_tokens
        pending = False
        for rid in scheduler_output.num_scheduled_tokens:
            req = requests[rid]
            if req.is_prefill_chunk:
                continue  # nothing is sampled by a chunk that stops short of the known tokens
            # The grammar has not seen the in-flight token yet: sampling must wait for it.
            if req.use_structured_output and req.num_output_placeholders > 0:
                pending = True
            # One placeholder for the sampled token, one per draft it verifies (docs/design.md,
            # "Draft tokens as placeholders").
            req.num_output_placeholders += self.num_sampled_tokens_per_step + len(spec_tokens.get(rid, ()))
            if num_spec:
                # The worker proposes up to k drafts after this step's sample and keeps them; the next
                # step reserves their positions without knowing their ids (as many as the worker
                # last asked for: none while its drafts for the request keep missing).
                slots = num_spec if req.num_draft_slots is None else min(num_spec, req.num_draft_slots)
                req.spec_token_ids = [-1] * slots
        scheduler_output.pending_structured_output_tokens |= pending

    def _update_draft_token_ids(self, req: Request, draft_token_ids: list[int] | None,
                                draft_slots: int | None = None) -> None:
        # The drafts stay on the worker; spec_token_ids holds their placeholders, as many as it asks for.
        if draft_slots is not None:
            req.num_draft_slots = draft_slots
        if req.use_structured_output:  # its next step's bitmask follows them
            req.worker_draft_token_ids = list(draft_token_ids or ())

    @staticmethod
    def _step_drafts(req: Request, scheduled: list[int] | None) -> list[int]:
        """A grammar request's -1 slots hold the worker's drafts, reported in the output processed just
        before this bitmask (the step's sampling waits for it), padded as the worker pads them: with the
        last token (worker/spec_decode/spec_decoder.py, step_drafts). Should they differ from what the worker
        laid out, the worker accepts no draft past the difference."""
        if not scheduled:
            return []
        own = req.worker_draft_token_ids[:len(scheduled)]
        return own + [req.all_token_ids[-1]] * (len(scheduled) - len(own))

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
