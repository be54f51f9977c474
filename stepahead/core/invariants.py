"""Checks of the scheduler's invariants (the table in docs/design.md, "Invariants").

Used by the scheduler in debug mode (SchedulerConfig.debug_invariants) and by the tests after every
operation. Each check raises AssertionError naming the invariant it found broken. The checks read
the scheduler through SchedulerState, so this module imports no scheduler module.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Protocol

from stepahead.core.block_pool import KVCacheBlock
from stepahead.core.kv_cache import KVCacheManager
from stepahead.core.sched_output import SchedulerOutput
from stepahead.core.sliding_window import num_skipped_blocks
from stepahead.request import Request, RequestStatus


class SchedulerState(Protocol):
    """What the checks read of a Scheduler."""

    uses_placeholders: bool
    by_priority: bool
    max_num_scheduled_tokens: int
    max_num_running_reqs: int
    max_request_len: int
    num_spec_tokens: int
    requests: dict[str, Request]
    running: list[Request]
    waiting: deque[Request]
    skipped_waiting: deque[Request]
    finished_req_ids: set[str]
    finished_in_flight_tokens: dict[str, int]
    kv_cache_manager: KVCacheManager


def _fail(code: str, msg: str) -> None:
    raise AssertionError(f"invariant {code} broken: {msg}")


def check_after_schedule(sched: SchedulerState, scheduler_output: SchedulerOutput) -> None:
    """I4 and I9 for the step just scheduled, P13, plus the global checks."""
    total = sum(scheduler_output.num_scheduled_tokens.values())
    if total != scheduler_output.total_num_scheduled_tokens:
        _fail("I9", f"total {scheduler_output.total_num_scheduled_tokens} != sum {total}")
    if total > sched.max_num_scheduled_tokens:
        _fail("I9", f"{total} tokens scheduled > budget {sched.max_num_scheduled_tokens}")
    if len(sched.running) > sched.max_num_running_reqs:
        _fail("I9", f"{len(sched.running)} running > max_num_seqs {sched.max_num_running_reqs}")
    for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
        req = sched.requests[rid]
        if num_scheduled <= 0:
            _fail("I9", f"{rid} scheduled for {num_scheduled} tokens")
        if req.status != RequestStatus.RUNNING:
            _fail("I9", f"scheduled {req} is not RUNNING")
        if req.num_computed_tokens > sched.max_request_len - 1:
            _fail("I9", f"{req} computes past max_request_len - 1 = {sched.max_request_len - 1}")
        num_drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(rid, ()))
        if num_drafts and (req.is_prefill_chunk or num_drafts > sched.num_spec_tokens or num_drafts >= num_scheduled):
            _fail("S1", f"{num_drafts} drafts in a step of {num_scheduled} tokens (chunk {req.is_prefill_chunk}, "
                        f"k {sched.num_spec_tokens}): {req}")
        # With every draft in flight accepted, the request holds num_computed + 1 tokens.
        if num_drafts and req.num_computed_tokens + 1 > req.num_prompt_tokens + req.max_tokens:
            _fail("S2", f"drafts scheduled past max_tokens: {req}")
        placeholders_before_step = req.num_output_placeholders
        if not req.is_prefill_chunk and sched.uses_placeholders:
            placeholders_before_step -= 1 + num_drafts  # the placeholders this step just added
        is_chunk = req.num_computed_tokens < req.num_tokens + placeholders_before_step
        if is_chunk != req.is_prefill_chunk:
            _fail("I4", f"is_prefill_chunk={req.is_prefill_chunk} but computed < num_tokens + placeholders "
                        f"is {is_chunk}: {req}")
    if scheduler_output.finished_req_ids is sched.finished_req_ids:
        _fail("P13", "finished_req_ids handed to an output is still the scheduler's live set")
    check_scheduler(sched)


def check_scheduler(sched: SchedulerState, in_flight: list[SchedulerOutput] | None = None) -> None:
    """Per-request counters (I1, I3, I7), queues, I2 against in_flight if given, then the KV pool."""
    uses_placeholders = sched.uses_placeholders
    queued = Counter(id(r) for r in (*sched.running, *sched.waiting, *sched.skipped_waiting))
    if len(queued) != len(sched.requests) or any(c != 1 for c in queued.values()):
        _fail("queues", "every unfinished request must sit in exactly one of running/waiting/skipped")
    for r in sched.running:
        if r.status != RequestStatus.RUNNING:
            _fail("queues", f"{r} in running")
    for r in (*sched.waiting, *sched.skipped_waiting):
        if r.status not in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.PREEMPTED):
            _fail("queues", f"{r} in waiting")
    if sched.by_priority:
        keys = [(r.priority, r.arrival_time) for r in sched.waiting]
        if keys != sorted(keys):
            _fail("Q1", f"the priority policy's waiting queue is out of (priority, arrival) order: {keys}")
    in_flight_tokens: Counter[str] = Counter()
    in_flight_drafts: Counter[str] = Counter()
    for scheduler_output in in_flight or ():
        in_flight_tokens.update(scheduler_output.num_scheduled_tokens)
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            in_flight_drafts[rid] += len(drafts)
    for rid, req in sched.requests.items():
        if req.request_id != rid:
            _fail("requests", f"{rid} maps to {req}")
        num_placeholders = req.num_output_placeholders
        num_stale = req.num_stale_output_tokens
        num_in_flight = req.num_in_flight_tokens
        if num_placeholders < 0 or num_stale < 0 or num_in_flight < 0:
            _fail("I1", f"negative counter: {req}")
        if not uses_placeholders and num_placeholders != 0:
            _fail("I1", f"sync scheduler with placeholders: {req}")
        if num_stale > num_in_flight:
            _fail("I7", f"stale > in flight: {req}")
        if in_flight is not None:
            # A finished holder of the same id may still have steps in flight.
            expected = in_flight_tokens[rid] - sched.finished_in_flight_tokens.get(rid, 0)
            if num_in_flight != expected:
                _fail("I2", f"in flight {num_in_flight} != tokens of unprocessed steps {expected}: {req}")
        _check_drafts(sched, req, in_flight_drafts[rid] if in_flight is not None else None)
        if req.status == RequestStatus.RUNNING and not req.is_prefill_chunk:
            # Positions of drafts still in flight are computed but not yet tokens (sync) or placeholders (async).
            num_tokens, num_computed = req.num_tokens, req.num_computed_tokens
            if not uses_placeholders:
                num_computed -= req.num_in_flight_draft_tokens
            if uses_placeholders and num_tokens + num_placeholders != num_computed + 1:
                _fail("I3", f"num_tokens + placeholders != computed + 1: {req}")
            if not uses_placeholders and not (num_computed <= num_tokens <= num_computed + 1):
                _fail("I3", f"sync: computed <= num_tokens <= computed + 1 fails: {req}")
        if req.status != RequestStatus.RUNNING and num_placeholders != 0:
            _fail("I1", f"placeholders on a request that is not running: {req}")
        grammar = req.structured_output
        if grammar is not None and grammar.matcher is not None and grammar.num_accepted_tokens != req.num_output_tokens:
            _fail("G1", f"grammar accepted {grammar.num_accepted_tokens} tokens, output has {req.num_output_tokens}: {req}")
    check_kv(sched)


def _check_drafts(sched: SchedulerState, req: Request, in_flight_drafts: int | None) -> None:
    """S3-S5: the draft counters (docs/design.md, "Draft tokens as placeholders")."""
    num_drafts = req.num_in_flight_draft_tokens
    if num_drafts < 0 or num_drafts > req.num_in_flight_tokens:
        _fail("S3", f"in-flight drafts outside [0, in flight]: {req}")
    if sched.uses_placeholders and num_drafts > req.num_output_placeholders:
        _fail("S3", f"in-flight drafts > placeholders: {req}")
    if req.status != RequestStatus.RUNNING and (num_drafts or req.spec_token_ids):
        _fail("S4", f"drafts on a request that is not running: {req} {req.spec_token_ids}")
    if len(req.spec_token_ids) > sched.num_spec_tokens:
        _fail("S4", f"{len(req.spec_token_ids)} drafts > num_speculative_tokens {sched.num_spec_tokens}: {req}")
    # Exact where no pre-preemption step or earlier holder of the id is still in flight.
    if (in_flight_drafts is not None and not req.num_stale_output_tokens
            and req.request_id not in sched.finished_in_flight_tokens and num_drafts != in_flight_drafts):
        _fail("S5", f"in-flight drafts {num_drafts} != drafts of unprocessed steps {in_flight_drafts}: {req}")


def check_kv(sched: SchedulerState) -> None:
    """I10 (block accounting, free-queue integrity; the null block is never counted, hashed or free),
    I5 (only real-token blocks are hashed) and I6 (only blocks out of the processed window are nulled)."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    null_block = pool.null_block
    if null_block.ref_cnt != 0 or null_block.block_hash is not None:
        _fail("I10", f"the null block was counted or hashed: {null_block}")
    holders: Counter[int] = Counter()
    for rid, blocks in kv.req_to_blocks.items():
        if rid not in sched.requests:
            _fail("I10", f"blocks held for unknown request {rid}")
        holders.update(b.block_id for b in blocks)
    free_ids = pool.free_block_queue.ids()
    if len(free_ids) != pool.free_block_queue.num_free_blocks or len(set(free_ids)) != len(free_ids):
        _fail("I10", "free queue length or uniqueness broken")
    free_set = set(free_ids)
    if 0 in free_set:
        _fail("I10", "null block in the free queue")
    for block in pool.blocks[1:]:
        if block.ref_cnt != holders[block.block_id]:
            _fail("I10", f"{block} ref_cnt != holders {holders[block.block_id]}")
        if (block.ref_cnt == 0) != (block.block_id in free_set):
            _fail("I10", f"{block}: free-queue membership disagrees with ref_cnt")
    if len(free_set) + sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0) != pool.num_usable_blocks:
        _fail("I10", "free + held != usable blocks")
    for block_hash, entry in pool.cached_block_hash_to_block.items():
        for block_id, block in entry.items():
            if block.block_id != block_id or block.block_hash != block_hash:
                _fail("I5", f"hash map entry {block_hash}:{block_id} -> {block}")
    for rid, blocks in kv.req_to_blocks.items():
        _check_window_nulls(kv, sched.requests[rid], blocks)
    for rid, blocks in kv.req_to_blocks.items():
        req = sched.requests[rid]
        num_full_blocks = req.num_tokens // kv.block_size
        for index, block in enumerate(blocks):
            if block.block_hash is None:
                continue
            if index >= num_full_blocks or index >= len(req.block_hashes) or req.block_hashes[index] != block.block_hash:
                _fail("I5", f"block {index} of {rid} is hashed but not a full block of real tokens")


def _check_window_nulls(kv: KVCacheManager, req: Request, blocks: list[KVCacheBlock]) -> None:
    """I6: the null block only as a prefix of a table, and only where no step can still read or write:
    wholly before the window of the next position to process. A stale share in flight writes the
    blocks the request held before its preemption, not these."""
    num_nulls = 0
    while num_nulls < len(blocks) and blocks[num_nulls] is kv.block_pool.null_block:
        num_nulls += 1
    if any(b is kv.block_pool.null_block for b in blocks[num_nulls:]):
        _fail("I6", f"null block after a real one in {req.request_id}'s table {[b.block_id for b in blocks]}")
    if not num_nulls:
        return
    if kv.sliding_window is None:
        _fail("I6", f"null blocks in {req.request_id}'s table without a sliding window")
        return
    num_processed = req.num_computed_tokens - (req.num_in_flight_tokens - req.num_stale_output_tokens)
    bound = num_skipped_blocks(num_processed, kv.sliding_window, kv.block_size)
    if num_nulls > bound:
        _fail("I6", f"{num_nulls} blocks nulled, but only {bound} lie before the window of position "
                    f"{num_processed}: {req}")
