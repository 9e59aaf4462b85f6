"""Acceptance estimators: how likely a source's drafted tokens are to be accepted, by position.

``AcceptanceBook`` keeps one ``AcceptanceTracker`` per draft source; the
draft-length policies (``draft_length``) and the drafters that choose between
sources (cascade, fusion, through ``budget.Advice``) read it.  ``best_k`` and
``expected_accepted`` turn its estimates into a draft length;
``ConfidenceCalibration`` maps a model draft's confidence to acceptance.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence


@dataclass
class AcceptanceTracker:
    """Per-position conditional acceptance a_i = P(token i accepted | tokens < i accepted).

    Counts decay by ``decay`` per observed draft so the estimate follows
    content changes (code -> prose) within a generation; a Beta(prior_a,
    prior_b) prior keeps unseen positions at a neutral value.
    """

    k_max: int = 32
    decay: float = 0.97
    prior_a: float = 1.0
    prior_b: float = 1.0
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reached = [0.0] * self.k_max
        self.accepted = [0.0] * self.k_max

    def update(self, n_drafted: int, n_accepted: int) -> None:
        if n_drafted == 0:
            return
        for i in range(self.k_max):
            self.reached[i] *= self.decay
            self.accepted[i] *= self.decay
        # Position i was reached if all before it were accepted.
        for i in range(min(n_drafted, n_accepted + 1, self.k_max)):
            self.reached[i] += 1.0
            if i < n_accepted:
                self.accepted[i] += 1.0

    def conditional(self) -> list[float]:
        """Estimates by position.  An unreached position borrows its predecessor's rate.

        Without that, positions beyond the k tried so far would sit at the
        neutral prior and a policy would never learn that longer drafts pay
        (acceptance along a matching run tends to stay high, not fall to 0.5).
        """
        out: list[float] = []
        strength = self.prior_a + self.prior_b
        for a, r in zip(self.accepted, self.reached):
            mean = out[-1] if out else (self.prior_a / strength if strength else 0.5)
            out.append((a + strength * mean) / (r + strength) if r + strength > 0 else mean)
        return out

    def n_observed(self) -> float:
        return self.reached[0]


class AcceptanceBook:
    """Acceptance by draft position, per source (one ``AcceptanceTracker`` each)."""

    def __init__(self, k_max: int = 32) -> None:
        self.k_max = k_max
        self.trackers: dict[str, AcceptanceTracker] = {}

    def tracker(self, source: str) -> "AcceptanceTracker":
        t = self.trackers.get(source)
        if t is None:
            t = self.trackers[source] = AcceptanceTracker(k_max=self.k_max)
        return t

    def update(self, source: str, n_drafted: int, n_accepted: int) -> None:
        self.tracker(source).update(n_drafted, n_accepted)

    def copy(self, weight: float = 1.0) -> "AcceptanceBook":
        """An independent copy, its evidence counted ``weight`` times (below 1: a prior the new owner's own
        outcomes soon outweigh)."""
        book = AcceptanceBook(self.k_max)
        book.trackers = {name: copy.deepcopy(t) for name, t in self.trackers.items()}
        if weight != 1.0:
            for t in book.trackers.values():
                t.reached = [r * weight for r in t.reached]
                t.accepted = [a * weight for a in t.accepted]
        return book

    def conditional(self, source: str, n: int = 0) -> list[float]:
        """Acceptance at positions 1..max(n, k_max); deep positions keep the last tracked rate."""
        cond = self.tracker(source).conditional()
        return cond + [cond[-1]] * (n - len(cond)) if n > len(cond) else cond


def expected_accepted(cond: Sequence[float], k: int) -> float:
    """E[accepted | k] = sum_{j<=k} prod_{i<=j} a_i (tokens after a rejection never count)."""
    total, run = 0.0, 1.0
    for a in cond[:k]:
        run *= a
        total += run
    return total


def best_k(cond: Sequence[float], draft_cost: Callable[[int], float], verify_cost: Callable[[int], float],
           k_max: int, base_tokens: float = 0.0) -> int:
    """argmax over k in 0..k_max of (base + E[accepted | k] + 1) / (draft_cost(k) + verify_cost(k + 1)).

    k = 0 is a plain step: one token for verify_cost(1) and no draft cost.
    ``verify_cost(n)`` is the whole step's cost when this generation
    verifies n rows, and ``base_tokens`` what the other generations in the
    step are expected to commit (0 alone), so the aggregate rate is maximised.
    """
    best, best_rate = 0, (base_tokens + 1.0) / verify_cost(1)
    total, run = 0.0, 1.0
    for k in range(1, k_max + 1):
        run *= cond[k - 1]
        total += run
        rate = (base_tokens + total + 1.0) / (draft_cost(k) + verify_cost(k + 1))
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass
class ConfidenceCalibration:
    """Online map from a draft's confidence in a token to P(target accepts it | reached).

    Ten equal-width confidence bins with decayed counts; each bin starts at
    0.5 with the weight of two observations.  (Starting at the bin's midpoint,
    i.e. assuming a calibrated draft, was far too pessimistic for small drafts:
    pycoder-1m's tokens drafted at confidence < 0.1 were accepted 54% of the time.)
    """

    bins: int = 10
    decay: float = 0.995
    trusting: bool = False  # start each bin at its midpoint: for scores that are already probabilities
    # Bins on the odds of going on (bin b: 1 - 2^-b <= c < 1 - 2^-(b + 1)) rather than of equal width: for a
    # token's conditional confidence, where a 20-token match (0.955) and a 60-token one (0.984) must not share a bin
    # with a 9-token one (0.91), which the target refuses four times as often (``CostK._wager``)
    odds: bool = False
    prior: float = 2.0  # how many observations a trusting bin's start counts as (others: 2, at 1/2)
    trust_from: int = 0  # a trusting calibration trusts bins from this one up; those below start at 1/2
    accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        trusted = [self.trusting and b >= self.trust_from for b in range(self.bins)]
        self.reached = [self.prior if t else 2.0 for t in trusted]
        self.accepted = [n * (self._midpoint(b) if t else 0.5) for b, (n, t) in enumerate(zip(self.reached, trusted))]

    def _midpoint(self, b: int) -> float:
        """The confidence in the middle of bin ``b`` (a trusting calibration's start)."""
        return 1.0 - 2.0 ** -(b + 0.5) if self.odds else (b + 0.5) / self.bins

    def _bin(self, c: float) -> int:
        if self.odds:
            return min(int(-math.log2(max(1.0 - c, 2.0 ** -self.bins))), self.bins - 1)
        return min(int(c * self.bins), self.bins - 1)

    def prob(self, c: float) -> float:
        b = self._bin(c)
        return self.accepted[b] / self.reached[b]

    def lower(self, c: float, z: float) -> float:
        """Wilson's lower confidence bound (``z`` standard errors) on P(accept | reached) at confidence ``c``, from
        the bin's decayed counts: what the cost policy's wager prices (``CostK._wager``), so that a bin seen a few
        times is trusted little and one seen hundreds of times nearly at its rate."""
        b = self._bin(c)
        n, p = self.reached[b], self.accepted[b] / self.reached[b]
        zz = z * z
        centre = p + zz / (2 * n)
        spread = z * math.sqrt(max(0.0, p * (1 - p) / n + zz / (4 * n * n)))
        return max(0.0, (centre - spread) / (1 + zz / n))

    def update(self, confidences: Sequence[float], n_accepted: int) -> None:
        for i, c in enumerate(confidences[: n_accepted + 1]):
            b = self._bin(c)
            self.reached[b] = self.reached[b] * self.decay + 1.0
            self.accepted[b] = self.accepted[b] * self.decay + (1.0 if i < n_accepted else 0.0)
