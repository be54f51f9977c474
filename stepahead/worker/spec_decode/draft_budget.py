"""How many drafts a step can afford: each draft position is a row of the next forward pass, paid for
whether it is accepted or not.

Where a step is bound by reading the weights (a GPU at small batches) a row costs little and drafting
pays at modest acceptance; where it is bound by arithmetic (a CPU, whose cores multiply every row, or
any device at large batches) a row costs about what it may save. So the worker measures what a row
costs and drafts only where a position's chance of acceptance outweighs it:

- `StepCost` fits a line through recent decode steps' wall times: seconds = base + per_row * rows (least
  squares over the last STEP_WINDOW steps that held only decode and draft rows);
- each request's chance that a draft position is accepted, given the ones before it were, is `p`
  (DraftTrack.acceptance), so its j-th draft is reached and accepted with chance p^j;
- `allocate_drafts` takes positions in decreasing order of that chance while it exceeds the share of
  the step the extra row costs. With T tokens expected from R rows, a row of chance v raises the
  tokens per second T / (base + per_row * R) exactly when v > per_row * T / (base + per_row * R).

Greedy output never depends on how many drafts a step verifies (verification keeps the target's
tokens), so the measured times steer only the speed.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

# Decode steps in the cost fit, and the fewest before it is trusted.
STEP_WINDOW = 64
MIN_STEPS = 16
# The fit needs steps of different sizes: the rows' variance across the window must reach this.
MIN_ROWS_VARIANCE = 0.5


@dataclass
class StepCost:
    """seconds = base + per_row * rows, fitted over recent decode steps."""

    samples: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    base: float = 0.0
    per_row: float = 0.0
    fitted: bool = False

    def record(self, rows: int, seconds: float) -> None:
        self.samples.append((rows, seconds))
        if len(self.samples) < MIN_STEPS:
            return
        n = len(self.samples)
        mean_rows = sum(r for r, _ in self.samples) / n
        mean_s = sum(s for _, s in self.samples) / n
        variance = sum((r - mean_rows) ** 2 for r, _ in self.samples) / n
        if variance < MIN_ROWS_VARIANCE:
            return  # steps all of one size say nothing about a row's cost: keep the last fit
        covariance = sum((r - mean_rows) * (s - mean_s) for r, s in self.samples) / n
        self.per_row = max(covariance / variance, 0.0)
        self.base = max(mean_s - self.per_row * mean_rows, 0.0)
        self.fitted = True


def allocate_drafts(chances: list[float], caps: list[int], num_plain_rows: int, cost: StepCost) -> list[int]:
    """Drafts per request (at most caps[i]) for a step of num_plain_rows rows without drafts, request
    i's positions accepted with chance chances[i] each: the positions whose chance p_i^j pays for its
    row, taken in decreasing order of that chance (a request's own positions come in order, as p_i^j
    falls with j)."""
    counts = [0] * len(chances)
    heap = [(-p, i) for i, (p, cap) in enumerate(zip(chances, caps, strict=True)) if cap > 0 and p > 0]
    heapq.heapify(heap)
    tokens = rows = float(num_plain_rows)
    while heap:
        negative, i = heapq.heappop(heap)
        value = -negative
        if value * (cost.base + cost.per_row * rows) <= cost.per_row * tokens:
            break  # no later position pays either: their chances are lower and the bar only rises
        counts[i] += 1
        tokens += value
        rows += 1
        if counts[i] < caps[i]:
            heapq.heappush(heap, (-value * chances[i], i))
    return counts
