"""The draft budget: a row's cost fitted from step times, and drafts only where they pay for their rows."""

from __future__ import annotations

import pytest

from stepahead.worker.spec_decode.draft_budget import MIN_STEPS, StepCost, allocate_drafts
from stepahead.worker.spec_decode.draft_track import DraftTrack


def _cost(base: float, per_row: float) -> StepCost:
    cost = StepCost()
    for i in range(2 * MIN_STEPS):
        rows = 1 + i % 5
        cost.record(rows, base + per_row * rows)
    return cost


def test_the_fit_recovers_a_rows_cost_and_waits_for_steps_of_different_sizes():
    flat = StepCost()
    for _ in range(3 * MIN_STEPS):
        flat.record(4, 0.01)
    assert not flat.fitted  # one size: nothing to tell a row's cost by
    cost = _cost(0.002, 0.0005)
    assert cost.fitted and cost.base == pytest.approx(0.002) and cost.per_row == pytest.approx(0.0005)


def _throughput(chances: list[float], counts: list[int], plain_rows: int, cost: StepCost) -> float:
    tokens = plain_rows + sum(sum(p ** j for j in range(1, n + 1)) for p, n in zip(chances, counts, strict=True))
    return tokens / (cost.base + cost.per_row * (plain_rows + sum(counts)))


def test_drafts_are_the_ones_that_raise_tokens_per_second():
    """Exhaustively over every allocation of a small batch: the budget's is the best one."""
    import itertools

    for cost in (_cost(0.003, 0.0008), _cost(0.01, 0.00005), _cost(0.001, 0.001)):
        for chances in ([0.9], [0.95, 0.5, 0.2], [0.7, 0.7, 0.99]):
            k = 4
            counts = allocate_drafts(chances, [k] * len(chances), len(chances), cost)
            best = max(_throughput(chances, list(c), len(chances), cost)
                       for c in itertools.product(range(k + 1), repeat=len(chances)))
            assert _throughput(chances, counts, len(chances), cost) == pytest.approx(best)


def test_a_cheap_row_drafts_the_most_and_a_dear_one_nothing():
    """Bound by reading the weights (rows almost free), k drafts even at modest acceptance; bound by
    arithmetic at a large batch (a row costs what it may bring), none."""
    assert allocate_drafts([0.6], [4], 1, _cost(0.01, 0.00001)) == [4]
    assert allocate_drafts([0.9] * 32, [4] * 32, 32, _cost(0.001, 0.001)) == [0] * 32
    assert allocate_drafts([0.9, 0.9], [2, 0], 2, _cost(0.01, 0.00001)) == [2, 0]  # caps hold


def test_acceptance_follows_the_verified_drafts_and_fades():
    track = DraftTrack()
    assert track.acceptance() == 0.5  # one of each to start from
    for _ in range(10):
        track.num_verifying = 4
        track.note_verified(4)  # all accepted: no rejection
    assert track.acceptance() > 0.95
    for _ in range(30):  # each step that accepts nothing is one rejection
        track.num_verifying = 4
        track.note_verified(0)
    assert track.acceptance() < 0.3
    for _ in range(60):  # steps without drafts: the evidence fades back to the start
        track.note_verified(0)
    assert track.acceptance() == pytest.approx(0.5, abs=0.01)
