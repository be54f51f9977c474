"""The synchronous scheduler: schedule(), update_from_output(), preemption, stale output, frees.

The async subclass changes only the two hooks _update_after_schedule and
_update_request_with_output; everything else is shared. schedule() runs the running phase, then the
waiting phase, each a method of its own; what they decided is gathered in a StepPlan and turned into
the worker's SchedulerOutput by step_plan.py. The state the scheduler owns, and admission, preemption
and freeing, are in request_lifecycle.py.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from stepahead.core.grammar_backend import StructuredOutputBackend
from stepahead.core.invariants import check_after_schedule, check_scheduler
from stepahead.core.request_lifecycle import RequestLifecycle
from stepahead.core.sched_output import EngineCoreOutput, GrammarOutput, ModelRunnerOutput, SchedulerOutput
from stepahead.core.step_plan import StepPlan, make_scheduler_output
from stepahead.core.stop import check_stop
from stepahead.core.waiting_order import priority_key
from stepahead.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class Scheduler(RequestLifecycle):
    """Decides, step by step, which requests run and for how many tokens; owns every unfinished request.

    Owns the request queues (running, waiting, skipped_waiting), the KV cache manager and the
    per-request counters. The caller hands every scheduled step's output to update_from_output
    once, oldest first (checked in debug mode). Guarantees: each step respects the token budget,
    max_num_seqs and the context length; each token reaches the caller once, in order, never after
    its request finished; a finished or preempted request's blocks go back to the pool at once
    (docs/design.md, "Freeing blocks"). This class schedules synchronously (one step at a time);
    AsyncScheduler schedules ahead of the outputs with placeholders. The invariants it keeps are
    listed in docs/design.md, "Invariants".
    """

    # Whether scheduled-but-unsampled tokens are counted as placeholders (docs/design.md, "Placeholders").
    uses_placeholders: bool = False

    # -- schedule ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.current_step += 1
        plan = StepPlan.with_budget(self.max_num_scheduled_tokens)
        if self.by_priority:
            self._give_seat_to_urgent()
        self._schedule_running(plan)
        if not plan.preempted:  # waiting requests never join a step that preempted
            self._schedule_waiting(plan)
        assert len(self.running) <= self.max_num_running_reqs
        scheduler_output = make_scheduler_output(
            plan, self.kv_cache_manager, self.prev_step_scheduled_req_ids, self.finished_req_ids,
            self.reset_preempted_req_ids, self.current_step)
        self.prev_step_scheduled_req_ids = set(plan.num_scheduled)
        self._update_after_schedule(scheduler_output)
        if self.debug_invariants:
            self._debug_in_flight.append(scheduler_output)
            check_after_schedule(self, scheduler_output)
        return scheduler_output

    def _schedule_running(self, plan: StepPlan) -> None:
        """Running requests, in admission order; preempts from the back when blocks run out."""
        kv = self.kv_cache_manager
        max_request_len = self.max_request_len
        threshold = self.scheduler_config.long_prefill_token_threshold
        running = self.running
        i = 0
        while i < len(running) and plan.token_budget > 0:
            req = running[i]
            num_placeholders = req.num_output_placeholders
            num_computed = req.num_computed_tokens
            # The max_tokens guard: once the steps in flight return, the request holds at least
            # num_tokens + the placeholders that are not drafts (each is one sure token; drafts may
            # all be rejected). If that reaches its cap, another step would only compute for a
            # finished request (docs/design.md, "The max_tokens guard").
            num_sure = num_placeholders - req.num_in_flight_draft_tokens
            if num_placeholders > 0 and req.num_tokens + num_sure >= req.num_prompt_tokens + req.max_tokens:
                i += 1
                continue
            # The gap formula (docs/design.md, "The gap formula"), with this step's drafts.
            num_new = req.num_tokens + self._num_drafts_allowed(req) + num_placeholders - num_computed
            if 0 < threshold < num_new:
                num_new = threshold
            num_new = min(num_new, plan.token_budget, max_request_len - num_computed - 1)
            if num_new <= 0:
                i += 1
                continue
            new_blocks = kv.allocate_slots(req, num_new)
            while new_blocks is None:
                # FCFS: the most recently admitted request; priority: the least urgent of those not
                # scheduled in this step (blocks already given to a scheduled one are hashed for the
                # tokens it will compute, so it cannot give them back).
                index = len(running) - 1
                if self.by_priority:
                    unscheduled = (r for r in running if r.request_id not in plan.num_scheduled)
                    index = running.index(max(unscheduled, key=priority_key))
                victim = running.pop(index)
                if index < i:
                    i -= 1
                self._preempt_request(victim, drop_stale_output=False)
                plan.preempted.append(victim)
                if victim is req:
                    break
                new_blocks = kv.allocate_slots(req, num_new)
            if new_blocks is None:
                return  # later running requests are not scheduled in this step
            plan.running.append(req)
            plan.schedule(req, num_new)
            plan.new_blocks_of[req.request_id] = [b.block_id for b in new_blocks] if new_blocks else None
            if req.spec_token_ids:
                # The positions past the known tokens and the placeholders are this step's drafts
                # (fewer than proposed where a cap cut num_new).
                num_spec = num_new + num_computed - req.num_tokens - num_placeholders
                if num_spec > 0:
                    plan.spec_tokens[req.request_id] = req.spec_token_ids[:num_spec]
                req.spec_token_ids = []
            i += 1

    @staticmethod
    def _num_drafts_allowed(req: Request) -> int:
        """The request's drafts, never more than max_tokens leaves room for, counting every in-flight
        placeholder as a token (conservative: an accepted run past max_tokens is wasted compute)."""
        if not req.spec_token_ids:
            return 0
        room = req.num_prompt_tokens + req.max_tokens - req.num_tokens - req.num_output_placeholders - 1
        return max(0, min(len(req.spec_token_ids), room))

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Skipped (stale-gated) then waiting requests, in order, while blocks and seats last; never preempts."""
        kv = self.kv_cache_manager
        threshold = self.scheduler_config.long_prefill_token_threshold
        chunked = self.scheduler_config.enable_chunked_prefill
        step_skipped: list[Request] = []
        while (self.skipped_waiting or self.waiting) and plan.token_budget > 0:
            if len(self.running) >= self.max_num_running_reqs:
                break
            queue = self._next_waiting_queue()
            req = queue[0]
            if req.status == RequestStatus.WAITING_FOR_GRAMMAR and not self._grammar_ready(req):
                queue.popleft()  # others go ahead while it compiles
                if not req.is_finished():
                    step_skipped.append(req)
                continue
            if req.num_stale_output_tokens and not req.drop_stale_output:
                # Deliverable stale output still in flight: resuming now could resample a
                # position that output later delivers (docs/design.md, "Stale output").
                queue.popleft()
                step_skipped.append(req)
                continue
            hit_blocks, num_hit = kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit
            if 0 < threshold < num_new:
                num_new = threshold
            if not chunked and num_new > plan.token_budget:
                break
            num_new = min(num_new, plan.token_budget)
            new_blocks = kv.allocate_slots(req, num_new, num_hit, hit_blocks)
            if new_blocks is None:
                break  # head-of-line blocking
            queue.popleft()
            self.running.append(req)
            (plan.new if req.status == RequestStatus.WAITING else plan.resumed).append(req)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            kv.record_prefix_lookup(req.num_tokens, num_hit)
            plan.schedule(req, num_new)
        if step_skipped:
            self.skipped_waiting.extendleft(reversed(step_skipped))

    def _next_waiting_queue(self) -> deque[Request]:
        """The queue whose head is admitted next: the skipped requests first under fcfs; under priority
        whichever head is more urgent."""
        if not self.skipped_waiting:
            return self.waiting
        if self.by_priority and self.waiting and priority_key(self.waiting[0]) < priority_key(self.skipped_waiting[0]):
            return self.waiting
        return self.skipped_waiting

    def _give_seat_to_urgent(self) -> None:
        """Under the priority policy, before anything is scheduled: while every seat is taken and the most
        urgent waiting request that could be admitted now has a strictly better priority than the least
        urgent running one, that one is preempted (its steps in flight become stale output) and the
        waiting phase admits the other. Equal priorities never displace each other, so two requests
        cannot take turns."""
        while self.running and len(self.running) >= self.max_num_running_reqs:
            urgent = min((r for r in (*self.skipped_waiting, *self.waiting) if self._admissible_now(r)),
                         key=priority_key, default=None)
            victim = max(self.running, key=priority_key)
            if urgent is None or victim.priority <= urgent.priority:
                return
            self.running.remove(victim)
            self._preempt_request(victim, drop_stale_output=False)

    def _admissible_now(self, request: Request) -> bool:
        """Neither waiting for its grammar nor for stale output still in flight (read only: the waiting
        phase finishes a failed compile)."""
        if request.num_stale_output_tokens and not request.drop_stale_output:
            return False
        grammar_manager = self.structured_output_manager
        return request.status != RequestStatus.WAITING_FOR_GRAMMAR or (
            grammar_manager is not None and grammar_manager.is_ready(request)
            and grammar_manager.compile_error(request) is None)

    def _grammar_ready(self, request: Request) -> bool:
        """Whether a request waiting for its grammar may be admitted now. A failed compile finishes
        it with "error" (the output is handed out by take_error_outputs)."""
        grammar_manager = self.structured_output_manager
        assert grammar_manager is not None, "only a configured backend puts requests in WAITING_FOR_GRAMMAR"
        if not grammar_manager.is_ready(request):
            return False
        error = grammar_manager.compile_error(request)
        if error is not None:  # finished here, not by fail_request: that removes it from the queue the caller walks
            logger.error("request %s: %s", request.request_id, error)
            request.status = RequestStatus.FINISHED_ERROR
            self._free_request(request)
            self.error_outputs.append(EngineCoreOutput(request.request_id, [], "error", error))
            return False
        request.status = RequestStatus.WAITING
        return True

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        requests = self.requests
        has_grammar_requests = False
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            req = requests[rid]
            req.num_computed_tokens += num_scheduled
            req.num_in_flight_tokens += num_scheduled
            req.is_prefill_chunk = req.num_computed_tokens < req.num_tokens + req.num_output_placeholders
            if req.use_structured_output and not req.is_prefill_chunk:
                has_grammar_requests = True
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            requests[rid].num_in_flight_draft_tokens += len(drafts)
        scheduler_output.has_structured_output_requests = has_grammar_requests
        # Replace, never clear: the output just built holds references to these sets (P13).
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()

    # -- update ------------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        if self.debug_invariants:
            assert self._debug_in_flight and self._debug_in_flight[0] is scheduler_output, \
                "update_from_output must be called once per scheduled step, in FIFO order"
            self._debug_in_flight.popleft()
        outputs: list[EngineCoreOutput] = []
        row_of = {rid: row for row, rid in enumerate(model_runner_output.req_ids)}
        sampled_rows = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        stopped_running: list[Request] = []
        stopped_preempted: list[Request] = []
        grammar_manager = self.structured_output_manager
        failed = model_runner_output.failed
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            if self._discard_finished_in_flight(rid, num_scheduled):
                continue
            req = self.requests.get(rid)
            if req is None:
                continue
            req.num_in_flight_tokens -= num_scheduled
            is_stale = False
            if req.num_stale_output_tokens > 0:
                is_stale = True
                req.num_stale_output_tokens -= num_scheduled
                assert req.num_stale_output_tokens >= 0, req
            num_drafts = len(spec_tokens[rid]) if rid in spec_tokens else 0
            if num_drafts and not is_stale:  # preemption zeroed the stale share's drafts
                req.num_in_flight_draft_tokens -= num_drafts
                assert req.num_in_flight_draft_tokens >= 0, req
            if is_stale and req.drop_stale_output:
                continue
            if rid in failed:
                continue  # failed below, after the loop
            row = row_of.get(rid)
            sampled = sampled_rows[row] if row is not None else ()
            prompt_logprobs = model_runner_output.prompt_logprobs.get(rid)
            if not sampled:  # a prefill chunk: nothing sampled, only its prompt logprobs (if asked) emitted
                if prompt_logprobs is not None:
                    outputs.append(EngineCoreOutput(rid, [], new_prompt_logprobs=prompt_logprobs))
                continue
            if num_drafts:
                assert len(sampled) <= 1 + num_drafts, f"{rid}: {len(sampled)} tokens from {num_drafts} drafts"
                self._reconcile_drafts(req, num_drafts, len(sampled) - 1, is_stale)
            status_before = req.status
            is_first_output = req.num_output_tokens == 0
            new_ids, stopped = self._update_request_with_output(req, list(sampled), is_stale)
            if new_ids and grammar_manager is not None and req.use_structured_output and not req.is_finished():
                error = self._grammar_accept(grammar_manager, req, new_ids)
                if error is not None:
                    req.stop_reason = error
                    logger.error("request %s: %s", rid, req.stop_reason)
                    req.status = RequestStatus.FINISHED_ERROR
                    stopped = True
                elif grammar_manager.is_terminated(req):
                    # The grammar took an end token the stop rules let through (ignore_eos): it is done.
                    req.status = RequestStatus.FINISHED_STOPPED
                    stopped = True
            if not stopped and not is_stale and self.num_spec_tokens:
                self._update_draft_token_ids(req, model_runner_output.draft_token_ids.get(rid),
                                             model_runner_output.draft_slots.get(rid))
            finish_reason = None
            if stopped:
                finish_reason = req.get_finished_reason()
                self._free_request(req)
                (stopped_running if status_before == RequestStatus.RUNNING else stopped_preempted).append(req)
            if new_ids or stopped or prompt_logprobs is not None:
                token_logprobs = logprobs.get(rid) if logprobs else None
                outputs.append(EngineCoreOutput(
                    rid, new_ids, finish_reason, req.stop_reason,
                    new_logprobs=token_logprobs[:len(new_ids)] if token_logprobs else None,
                    num_cached_tokens=max(req.num_cached_tokens, 0) if is_first_output else 0,
                    new_prompt_logprobs=prompt_logprobs,
                    first_scheduled_time=req.first_scheduled_time if is_first_output else None,
                ))
        if stopped_running:
            gone = {id(r) for r in stopped_running}
            self.running = [r for r in self.running if id(r) not in gone]
        for req in stopped_preempted:
            self._remove_from_waiting(req)
        for rid, reason in failed.items():
            self.fail_request(rid, reason)
        if self.debug_invariants:
            check_scheduler(self, list(self._debug_in_flight))
        return outputs

    def _reconcile_drafts(self, req: Request, num_drafts: int, num_accepted: int, is_stale: bool) -> None:
        """Roll back the rejected drafts' positions before the accepted tokens are appended. Their KV
        slots stay allocated and are overwritten by the next step. A stale output rolls back
        nothing: preemption reset the counters."""
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_drafts += 1
        for pos in range(num_accepted):  # the j-th draft is accepted only with every one before it
            self.num_accepted_tokens_per_pos[pos] += 1
        if is_stale:
            return
        num_rejected = num_drafts - num_accepted
        req.num_computed_tokens -= num_rejected
        if self.uses_placeholders:
            req.num_output_placeholders -= num_rejected

    def _update_draft_token_ids(self, req: Request, draft_token_ids: list[int] | None,
                                draft_slots: int | None = None) -> None:
        """Keep the worker's proposals for the request's next step (synchronous scheduling; the async
        scheduler overrides this: its worker keeps the drafts and says how many slots to reserve).
        A grammar request keeps the drafts its grammar accepts after the output so far."""
        if not draft_token_ids:
            return
        drafts = list(draft_token_ids[:self.num_spec_tokens])
        if req.use_structured_output:
            drafts = drafts[:self._grammatical_prefix(req, drafts)]
        req.spec_token_ids = drafts

    def _grammatical_prefix(self, req: Request, drafts: list[int]) -> int:
        grammar_manager = self.structured_output_manager
        if grammar_manager is None:
            return len(drafts)
        try:
            return grammar_manager.grammatical_prefix(req, drafts)
        except Exception as e:  # the matcher's failure shows when the bitmask is built; draft nothing
            logger.warning("request %s: drafts not checked by its grammar: %r", req.request_id, e)
            return 0

    @staticmethod
    def _grammar_accept(grammar_manager: StructuredOutputBackend, req: Request, new_ids: list[int]) -> str | None:
        """Advance the request's grammar; why it failed (a rejected token, a matcher error), or None."""
        try:
            if grammar_manager.accept_tokens(req, new_ids):
                return None
            return f"the grammar rejected sampled tokens {new_ids}"
        except Exception as e:  # one request's grammar fails that request alone
            return f"the grammar matcher failed: {e!r}"

    def _discard_finished_in_flight(self, rid: str, num_tokens: int) -> bool:
        """True for a step computed for a request that had already finished: its output is wasted."""
        left = self.finished_in_flight_tokens.get(rid)
        if left is None:
            return False
        self.num_wasted_request_steps += 1
        if left <= num_tokens:
            del self.finished_in_flight_tokens[rid]
        else:
            self.finished_in_flight_tokens[rid] = left - num_tokens
        return True

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int], is_stale: bool = False
    ) -> tuple[list[int], bool]:
        """Append token by token, checking stop after each; truncate at the first stop."""
        append = request.append_output_token_ids
        for k, token_id in enumerate(new_token_ids):
            append(token_id)
            if self._check_stop(request):
                return new_token_ids[:k + 1], True
        return new_token_ids, False

    def _check_stop(self, request: Request) -> bool:
        return check_stop(request, self.max_request_len)

    # -- grammars ---------------------------------------------------------------------------------

    def wait_for_grammars(self, timeout: float) -> None:
        """With nothing running, block until a waiting request's grammar has compiled (at most timeout
        seconds), instead of spinning through empty steps while the compile thread needs the CPU."""
        if self.running or self.structured_output_manager is None:
            return
        compiling = [r for r in (*self.skipped_waiting, *self.waiting)
                     if r.status == RequestStatus.WAITING_FOR_GRAMMAR]
        if compiling:
            self.structured_output_manager.wait_for_any(compiling, timeout)

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        if not scheduler_output.has_structured_output_requests or self.structured_output_manager is None:
            return None
        reqs = [r for rid in scheduler_output.num_scheduled_tokens
                if (r := self.requests.get(rid)) is not None and r.use_structured_output and not r.is_prefill_chunk]
        if not reqs:
            return None
        drafts = [self._step_drafts(r, scheduler_output.scheduled_spec_decode_tokens.get(r.request_id))
                  for r in reqs]
        followed = None
        if any(drafts):
            bitmask, followed, failed = self.structured_output_manager.draft_bitmask(reqs, drafts)
        else:
            bitmask, failed = self.structured_output_manager.grammar_bitmask(reqs)
        for rid, reason in failed.items():
            self.fail_request(rid, reason)
        return GrammarOutput([r.request_id for r in reqs], bitmask, followed)

    @staticmethod
    def _step_drafts(req: Request, scheduled: list[int] | None) -> list[int]:
        """The drafts a step verifies for a grammar request: their ids as scheduled (the async scheduler
        overrides this for its -1 slots)."""
        return list(scheduled or ())
