"""Checks of the engine-spec §2.3 invariants (DESIGN.md "Invariants").

Used by the scheduler in debug mode (SchedulerConfig.debug_invariants) and by the tests after every
operation. Each check raises AssertionError naming the invariant it found broken.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from stepahead.core.sched_output import SchedulerOutput
from stepahead.request import RequestStatus

if TYPE_CHECKING:
    from stepahead.core.scheduler import Scheduler


def _fail(code: str, msg: str) -> None:
    raise AssertionError(f"invariant {code} broken: {msg}")


def check_after_schedule(sched: Scheduler, out: SchedulerOutput) -> None:
    """I4 and I9 for the step just scheduled, plus the global checks."""
    total = sum(out.num_scheduled_tokens.values())
    if total != out.total_num_scheduled_tokens:
        _fail("I9", f"total {out.total_num_scheduled_tokens} != sum {total}")
    if total > sched.max_num_scheduled_tokens:
        _fail("I9", f"{total} tokens scheduled > budget {sched.max_num_scheduled_tokens}")
    if len(sched.running) > sched.max_num_running_reqs:
        _fail("I9", f"{len(sched.running)} running > max_num_seqs {sched.max_num_running_reqs}")
    for rid, n in out.num_scheduled_tokens.items():
        req = sched.requests[rid]
        if n <= 0:
            _fail("I9", f"{rid} scheduled for {n} tokens")
        if req.status != RequestStatus.RUNNING:
            _fail("I9", f"scheduled {req} is not RUNNING")
        if req.num_computed_tokens > sched.max_model_len - 1:
            _fail("I9", f"{req} computes past max_model_len - 1 = {sched.max_model_len - 1}")
        ph_before_step = req.num_output_placeholders
        if not req.is_prefill_chunk and _is_async(sched):
            ph_before_step -= 1  # the placeholder this step just added
        chunk = req.num_computed_tokens < req.num_tokens + ph_before_step
        if chunk != req.is_prefill_chunk:
            _fail("I4", f"is_prefill_chunk={req.is_prefill_chunk} but comp < ntok + ph is {chunk}: {req}")
    if out.finished_req_ids is sched.finished_req_ids:
        _fail("P13", "finished_req_ids handed to an output is still the scheduler's live set")
    check_scheduler(sched)


def _is_async(sched: Scheduler) -> bool:
    from stepahead.core.async_scheduler import AsyncScheduler

    return isinstance(sched, AsyncScheduler)


def check_scheduler(sched: Scheduler, in_flight: list[SchedulerOutput] | None = None) -> None:
    """Per-request counters (I1, I3, I7), queues, I2/I12 against in_flight if given, then the KV pool."""
    is_async = _is_async(sched)
    queued = Counter(id(r) for r in (*sched.running, *sched.waiting, *sched.skipped_waiting))
    if len(queued) != len(sched.requests) or any(c != 1 for c in queued.values()):
        _fail("queues", "every unfinished request must sit in exactly one of running/waiting/skipped")
    for r in sched.running:
        if r.status != RequestStatus.RUNNING:
            _fail("queues", f"{r} in running")
    for r in (*sched.waiting, *sched.skipped_waiting):
        if r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            _fail("queues", f"{r} in waiting")
    inflight_tokens: Counter[str] = Counter()
    for so in in_flight or ():
        inflight_tokens.update(so.num_scheduled_tokens)
    for rid, req in sched.requests.items():
        if req.request_id != rid:
            _fail("requests", f"{rid} maps to {req}")
        ph, stale, inflt = req.num_output_placeholders, req.num_stale_output_tokens, req.num_in_flight_tokens
        if ph < 0 or stale < 0 or inflt < 0:
            _fail("I1", f"negative counter: {req}")
        if not is_async and ph != 0:
            _fail("I1", f"sync scheduler with placeholders: {req}")
        if stale > inflt:
            _fail("I7", f"stale > inflt: {req}")
        if in_flight is not None:
            # A finished holder of the same id may still have steps in flight.
            expected = inflight_tokens[rid] - sched._finished_in_flight.get(rid, 0)
            if inflt != expected:
                _fail("I2", f"inflt {inflt} != tokens of unprocessed steps {expected}: {req}")
        if req.status == RequestStatus.RUNNING and not req.is_prefill_chunk:
            ntok, comp = req.num_tokens, req.num_computed_tokens
            if is_async and ntok + ph != comp + 1:
                _fail("I3", f"ntok + ph != comp + 1: {req}")
            if not is_async and not (comp <= ntok <= comp + 1):
                _fail("I3", f"sync: comp <= ntok <= comp + 1 fails: {req}")
        if req.status != RequestStatus.RUNNING and ph != 0:
            _fail("I1", f"placeholders on a request that is not running: {req}")
    if in_flight is not None and sched.defer_block_free:
        non_empty = sum(1 for so in in_flight if so.total_num_scheduled_tokens > 0)
        if sched.sched_step_seq - sched.processed_step_seq != non_empty:
            _fail("I12", f"seq gap {sched.sched_step_seq - sched.processed_step_seq} != {non_empty} in flight")
    check_kv(sched)


def check_kv(sched: Scheduler) -> None:
    """I10 (block accounting, free-queue integrity) and I5 (only real-token blocks are hashed)."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    holders: Counter[int] = Counter()
    for rid, blocks in kv.req_to_blocks.items():
        if rid not in sched.requests:
            _fail("I10", f"blocks held for unknown request {rid}")
        holders.update(b.block_id for b in blocks)
    for _, blocks in sched.deferred_frees:
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
        _fail("I10", "free + held + deferred != usable blocks")
    for h, entry in pool.cached_block_hash_to_block.items():
        for bid, block in entry.items():
            if block.block_id != bid or block.block_hash != h:
                _fail("I5", f"hash map entry {h}:{bid} -> {block}")
    for rid, blocks in kv.req_to_blocks.items():
        req = sched.requests[rid]
        full = req.num_tokens // kv.block_size
        for i, block in enumerate(blocks):
            if block.block_hash is None:
                continue
            if i >= full or i >= len(req.block_hashes) or req.block_hashes[i] != block.block_hash:
                _fail("I5", f"block {i} of {rid} is hashed but not a full block of real tokens")
