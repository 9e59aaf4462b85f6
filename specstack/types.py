"""Value types shared by the engine, drafters, verifier and reports.

Names follow the papers: ``p`` is the target's distribution, ``q`` the draft's.
Outcomes are *accepted* (a draft token kept), *recovered* (resampled after a
rejection) and *bonus* (the extra target token when every draft token is kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True, slots=True)
class Draft:
    """What a drafter proposes for one verification step.

    ``q`` is ``None`` for deterministic sources (n-gram lookup, greedy model
    drafts): the verifier then treats each token as a point mass.  When set it
    holds the distribution each token was *actually sampled from*, shape
    ``[len(token_ids), n_vocab]``; rejection sampling is only lossless if so.
    """

    token_ids: tuple[int, ...]
    source: str
    q: np.ndarray | None = None
    parents: tuple[int, ...] | None = None  # tree drafts: parent index per token, -1 = root

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncated(self, n: int) -> "Draft":
        """The first n tokens (and their q rows); trees are cut to their first n nodes."""
        if n >= len(self.token_ids):
            return self
        return Draft(
            token_ids=self.token_ids[:n],
            source=self.source,
            q=None if self.q is None else self.q[:n],
            parents=None if self.parents is None else self.parents[:n],
        )

    @staticmethod
    def empty(source: str) -> "Draft":
        return Draft(token_ids=(), source=source)


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Outcome of verifying one draft: the tokens to commit, in order.

    ``token_ids`` is the accepted draft prefix followed by exactly one target
    token (recovered on a rejection, bonus when all were accepted), so
    ``len(token_ids) == num_accepted + 1`` always.
    """

    token_ids: tuple[int, ...]
    num_accepted: int


@dataclass(frozen=True, slots=True)
class GenerationEvent:
    """One streamed piece of output text, with the tokens that produced it."""

    text: str
    token_ids: tuple[int, ...]


def as_token_tuple(ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(t) for t in ids)


__all__ = ["Draft", "VerifyResult", "GenerationEvent", "as_token_tuple"]
