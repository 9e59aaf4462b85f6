"""Policies that choose the draft budget k before each step.

The engine asks ``next_k()`` and reports each step's outcome through
``observe``; a policy sees statistics only, never a drafter's internals.
k = 0 means "do a plain decoding step".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .errors import InvalidParameterError


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What a policy may learn from one verification step."""

    source: str
    num_drafted: int
    num_accepted: int
    draft_s: float
    verify_s: float


class DraftLengthPolicy(Protocol):
    name: str

    def next_k(self) -> int:
        """Draft budget for the next step (>= 0)."""

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from the step just verified."""


class FixedK:
    """Always ask for k tokens (the user's habit, and llama.cpp's --draft-max)."""

    name = "fixed"

    def __init__(self, k: int = 4) -> None:
        if k < 1:
            raise InvalidParameterError(f"k must be >= 1 (got {k}); use --drafter none for plain decoding")
        self.k = k

    def next_k(self) -> int:
        return self.k

    def observe(self, outcome: StepOutcome) -> None:
        pass
