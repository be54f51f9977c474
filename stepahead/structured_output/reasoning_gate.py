"""The grammar waits for the reasoning to end (vLLM's rule with a reasoning parser).

A request whose StructuredOutputsParams carry `reasoning_end_token_ids` (the end-of-reasoning marker,
"</think>" as the tokenizer spells it) thinks freely: its bitmask rows allow every token and its matcher
sees nothing until the output has held that marker; the grammar then constrains only what follows it.
With `reasoning_start_token_ids` (qwen3) the output is reasoning only if it opens with that marker: the
first token may be the marker's first token or any token the grammar allows, and an output that began
the marker must finish it. Without them it begins in reasoning (deepseek_r1).

The gate advances with exactly the tokens that became output, like the matcher (invariant G1), so its
state is always the output's: nothing to roll back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from stepahead.sampling_params import StructuredOutputsParams


class Phase(Enum):
    OPENING = "opening"  # reading the output's first tokens for the start marker
    REASONING = "reasoning"  # unconstrained until the end marker
    CONSTRAINED = "constrained"  # the grammar applies


@dataclass
class ReasoningGate:
    end: tuple[int, ...]
    start: tuple[int, ...] | None  # None: the output begins in reasoning
    phase: Phase = Phase.REASONING
    opened: int = 0  # OPENING: how many tokens of the start marker the output began with
    tail: list[int] = field(default_factory=list)  # REASONING: the last tokens, for an end marker split across steps

    def __post_init__(self) -> None:
        if self.start is not None:
            self.phase = Phase.OPENING

    @classmethod
    def of(cls, params: StructuredOutputsParams) -> ReasoningGate | None:
        if not params.reasoning_end_token_ids:
            return None
        start = params.reasoning_start_token_ids
        return cls(tuple(params.reasoning_end_token_ids), tuple(start) if start else None)

    @property
    def constrained(self) -> bool:
        return self.phase is Phase.CONSTRAINED

    def forced_token(self) -> int | None:
        """The only token the next position allows: the rest of a start marker the output began."""
        if self.phase is Phase.OPENING and self.opened > 0:
            assert self.start is not None  # OPENING only exists with a start marker
            return self.start[self.opened]
        return None

    def marker_token(self) -> int | None:
        """A token the next position allows besides the grammar's: the start marker's first."""
        if self.phase is Phase.OPENING and self.opened == 0:
            assert self.start is not None
            return self.start[0]
        return None

    def feed(self, token_ids: list[int]) -> list[int]:
        """Advance over new output tokens; return those the grammar must accept (after the reasoning)."""
        for i, token in enumerate(token_ids):
            if self.phase is Phase.CONSTRAINED:
                return list(token_ids[i:])
            if self.phase is Phase.OPENING:
                assert self.start is not None
                if token == self.start[self.opened]:
                    self.opened += 1
                    if self.opened == len(self.start):
                        self.phase = Phase.REASONING
                    continue
                # Not the marker: the grammar reads the output from its start (a marker left half-way,
                # which the bitmask forbids, goes to the grammar too, which then rejects it).
                begun = list(self.start[:self.opened])
                self.phase = Phase.CONSTRAINED
                return begun + list(token_ids[i:])
            self.tail = (self.tail + [token])[-len(self.end):]
            if tuple(self.tail) == self.end:
                self.phase, self.tail = Phase.CONSTRAINED, []
        return []
