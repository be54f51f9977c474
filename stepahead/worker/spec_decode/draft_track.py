"""One request's drafting on the worker: its latest proposals, and whether proposing pays.

A drafting step costs its draft positions in the forward pass whether they hit or not (under async
scheduling the scheduler reserves them before the worker has proposed). A request whose drafts keep
missing, accepting nothing MISSES_BEFORE_PAUSE proposals in a row (a proposal the proposer could not
make counts as a miss), stops proposing for a pause of sampling steps, doubling up to MAX_PAUSE_STEPS
each time it misses again right after one; a proposal that is accepted even in part ends the streak
and resets the pause. The worker asks the async scheduler for as many draft slots as it just proposed
(none while paused).

Between pauses the number of drafts follows what the request accepts: one more than the moving
average of its accepted drafts (a step that accepted every draft counts one more than it verified,
so a request that keeps hitting grows back to k), so positions that would be rejected are not paid for.
With draft_policy "cost", once the worker knows what a row costs, the step's draft budget decides
instead (draft_budget.py), from `acceptance()`: the chance that a draft is accepted when the ones
before it were, counted over the request's verified drafts (each verifying step adds its accepted
drafts, and one rejection unless it accepted all), with old steps fading by ACCEPTANCE_DECAY a step
and one of each to start from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MISSES_BEFORE_PAUSE = 3
FIRST_PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 128
ACCEPTED_AVERAGE_WEIGHT = 0.3  # of the latest step, in the moving average of accepted drafts
ACCEPTANCE_DECAY = 0.9  # per sampling step, of the accepted and rejected drafts counted so far


@dataclass
class DraftTrack:
    drafts: list[int] = field(default_factory=list)  # proposed after the latest sample, not yet verified
    num_verifying: int = 0  # of the drafts the current step verifies, how many were proposed (not padding)
    misses: int = 0  # proposals in a row that accepted nothing
    paused_for: int = 0  # sampling steps left without proposing
    next_pause: int = FIRST_PAUSE_STEPS
    accepted_average: float | None = None  # moving average of accepted drafts per verifying step; None: none yet
    model_computed: int = 0  # draft model: positions of real tokens whose KV the draft model holds
    probs: torch.Tensor | None = None  # [len(drafts), vocab]: the q each draft was drawn from; None: one-hot
    verifying_probs: torch.Tensor | None = None  # q of the drafts the current step verifies (padding one-hot)
    resets: int = 0  # times the request resumed (a proposer's index of its tokens is then rebuilt)
    accepted_weight: float = 0.0  # accepted drafts, fading (acceptance())
    rejected_weight: float = 0.0  # rejections (one per verifying step that did not accept all), fading

    def note_verified(self, num_accepted: int) -> None:
        """The current step accepted num_accepted drafts; it counts only where it verified proposals
        (async scheduling may have reserved slots the worker had nothing for, padding included)."""
        self.accepted_weight *= ACCEPTANCE_DECAY
        self.rejected_weight *= ACCEPTANCE_DECAY
        if self.num_verifying == 0:
            return
        self.accepted_weight += num_accepted
        self.rejected_weight += 1 if num_accepted < self.num_verifying else 0
        observed = num_accepted + (1 if num_accepted >= self.num_verifying else 0)
        self.num_verifying = 0
        average = observed if self.accepted_average is None else self.accepted_average
        self.accepted_average = (1 - ACCEPTED_AVERAGE_WEIGHT) * average + ACCEPTED_AVERAGE_WEIGHT * observed
        if num_accepted > 0:
            self.misses = 0
            self.next_pause = FIRST_PAUSE_STEPS
        else:
            self._miss()

    def note_no_proposal(self) -> None:
        self._miss()

    def may_propose(self) -> bool:
        """Whether to propose after this sample; counts a paused step down."""
        if self.paused_for > 0:
            self.paused_for -= 1
            return False
        return True

    def num_drafts(self, k: int) -> int:
        """How many drafts to propose at most: 0 while paused, else 1 more than the average accepted,
        at most k (k before any step has verified)."""
        if self.paused or k == 0:
            return 0
        if self.accepted_average is None:
            return k
        return max(1, min(k, round(self.accepted_average) + 1))

    def acceptance(self) -> float:
        """The chance that a draft is accepted when the drafts before it were (see the top)."""
        return (self.accepted_weight + 1.0) / (self.accepted_weight + self.rejected_weight + 2.0)

    @property
    def paused(self) -> bool:
        return self.paused_for > 0

    def _miss(self) -> None:
        self.misses += 1
        if self.misses >= MISSES_BEFORE_PAUSE:
            self.misses = 0
            self.paused_for = self.next_pause
            self.next_pause = min(2 * self.next_pause, MAX_PAUSE_STEPS)

    def reset(self) -> None:
        """Preempted and resumed: the drafts were for a context the worker no longer holds."""
        self.drafts = []
        self.probs = self.verifying_probs = None
        self.num_verifying = 0
        self.model_computed = 0
        self.resets += 1
