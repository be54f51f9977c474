"""The order of the waiting queue under each scheduling policy (vLLM's --scheduling-policy).

fcfs: arrival order; a preempted request goes back to the front. priority: by (priority, arrival
time), lower first, so a preempted request goes back where its key puts it; requests of equal keys
keep their arrival order. Under priority a waiting request may also take the seat of a running one of a
strictly worse priority (Scheduler._give_seat_to_urgent), and the running request preempted for
blocks is the least urgent (Scheduler._schedule_running).
"""

from __future__ import annotations

from collections import deque

from stepahead.request import Request


def priority_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


def insert_by_priority(queue: deque[Request], request: Request) -> None:
    """Insert before the first request of a worse key, after its equals (a linear scan: the waiting
    queue is short next to a step's work)."""
    key = priority_key(request)
    for i, other in enumerate(queue):
        if priority_key(other) > key:
            queue.insert(i, request)
            return
    queue.append(request)
