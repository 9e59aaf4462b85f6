"""Policies that choose the draft budget k before each step.

The engine asks ``next_k()`` for a budget, lets the drafter propose, asks
``trim(source, n)`` how much of that source's draft is worth verifying, and
reports each outcome through ``observe``.  A policy sees statistics and
costs only, never a drafter's internals.  k = 0 means a plain decoding step.

Policies: ``fixed`` (k = N), ``window`` (the research notes' controller),
``heuristic`` (transformers' +2/-1 schedule) and ``cost`` (the default:
maximise expected committed tokens per second from measured costs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from .costs import CostModel
from .errors import InvalidParameterError


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What a policy may learn from one verification step."""

    source: str
    num_drafted: int
    num_accepted: int
    draft_s: float
    verify_s: float
    other_s: float = 0.0  # the loop's own bookkeeping in this step (observe, commit, policy)


class DraftLengthPolicy(Protocol):
    name: str

    def next_k(self) -> int:
        """Upper bound on the draft budget for the next step (>= 0)."""

    def trim(self, source: str, n: int) -> int:
        """How many of a ``source`` draft's ``n`` tokens to verify."""

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from the step just verified."""


def _check_k(k: int, what: str = "k") -> int:
    if k < 1:
        raise InvalidParameterError(f"{what} must be >= 1 (got {k}); use --drafter none for plain decoding")
    return k


class FixedK:
    """Always ask for k tokens (the user's habit, and llama.cpp's --draft-max)."""

    name = "fixed"

    def __init__(self, k: int = 4) -> None:
        self.k = _check_k(k)

    def next_k(self) -> int:
        return self.k

    def trim(self, source: str, n: int) -> int:
        return n

    def observe(self, outcome: StepOutcome) -> None:
        pass


class WindowK:
    """The research notes' controller: acceptance over a rolling window of draft tokens.

    Above ``high`` acceptance k grows by ``step``, below ``low`` it shrinks by
    ``step``, always within [k_min, k_max].  The window is cleared after a
    change so each decision sees only tokens drafted at the current k.
    """

    name = "window"

    def __init__(self, k: int = 8, k_min: int = 4, k_max: int = 24, window: int = 64,
                 high: float = 0.8, low: float = 0.6, step: int = 4) -> None:
        if not 1 <= k_min <= k_max:
            raise InvalidParameterError(f"window policy needs 1 <= k_min <= k_max (got {k_min}, {k_max})")
        self.k_min, self.k_max, self.window = k_min, k_max, window
        self.high, self.low, self.step = high, low, step
        self.k = min(max(k, k_min), k_max)
        self._drafted = 0
        self._accepted = 0

    def next_k(self) -> int:
        return self.k

    def trim(self, source: str, n: int) -> int:
        return n

    def observe(self, outcome: StepOutcome) -> None:
        self._drafted += outcome.num_drafted
        self._accepted += outcome.num_accepted
        if self._drafted < self.window:
            return
        rate = self._accepted / self._drafted
        if rate > self.high:
            self.k = min(self.k + self.step, self.k_max)
        elif rate < self.low:
            self.k = max(self.k - self.step, self.k_min)
        self._drafted = self._accepted = 0


class HeuristicK:
    """transformers' "heuristic" schedule: +2 when every draft token was accepted, else -1."""

    name = "heuristic"

    def __init__(self, k: int = 4, k_min: int = 1, k_max: int = 32) -> None:
        self.k_min, self.k_max = k_min, k_max
        self.k = min(max(_check_k(k), k_min), k_max)

    def next_k(self) -> int:
        return self.k

    def trim(self, source: str, n: int) -> int:
        return n

    def observe(self, outcome: StepOutcome) -> None:
        if outcome.num_drafted == 0:
            return
        if outcome.num_accepted == outcome.num_drafted:
            self.k = min(self.k + 2, self.k_max)
        else:
            self.k = max(self.k - 1, self.k_min)


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

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        for i in range(self.k_max):
            self.reached[i] *= self.decay
            self.accepted[i] *= self.decay
        # Position i was reached if all before it were accepted.
        for i in range(min(num_drafted, num_accepted + 1, self.k_max)):
            self.reached[i] += 1.0
            if i < num_accepted:
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


def expected_accepted(cond: Sequence[float], k: int) -> float:
    """E[accepted | k] = sum_{j<=k} prod_{i<=j} a_i (tokens after a rejection never count)."""
    total, run = 0.0, 1.0
    for a in cond[:k]:
        run *= a
        total += run
    return total


def best_k(cond: Sequence[float], draft_cost: Callable[[int], float], verify_cost: Callable[[int], float], k_max: int) -> int:
    """argmax over k in 0..k_max of (E[accepted | k] + 1) / (draft_cost(k) + verify_cost(k + 1)).

    k = 0 is a plain step: one token for verify_cost(1) and no draft cost.
    """
    best, best_rate = 0, 1.0 / verify_cost(1)
    total, run = 0.0, 1.0
    for k in range(1, k_max + 1):
        run *= cond[k - 1]
        total += run
        rate = (total + 1.0) / (draft_cost(k) + verify_cost(k + 1))
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
    accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted = [1.0] * self.bins
        self.reached = [2.0] * self.bins

    def _bin(self, c: float) -> int:
        return min(int(c * self.bins), self.bins - 1)

    def prob(self, c: float) -> float:
        b = self._bin(c)
        return self.accepted[b] / self.reached[b]

    def update(self, confidences: Sequence[float], num_accepted: int) -> None:
        for i, c in enumerate(confidences[: num_accepted + 1]):
            b = self._bin(c)
            self.reached[b] = self.reached[b] * self.decay + 1.0
            self.accepted[b] = self.accepted[b] * self.decay + (1.0 if i < num_accepted else 0.0)


@dataclass
class _SourceState:
    acceptance: AcceptanceTracker
    calibration: ConfidenceCalibration = field(default_factory=ConfidenceCalibration)
    last_confidences: list[float] = field(default_factory=list)
    per_token_s: float = 0.0  # EMA of draft time per drafted token
    calls: int = 0
    best_k: int | None = None  # cached best_k_for result
    best_k_step: int = 0


class CostK:
    """Pick the k that maximises expected committed tokens per second (the default policy).

    Expected tokens come from per-source acceptance by position; costs come
    from the target's measured verification curve t(n) (calibrated at load,
    refined online) and each source's measured draft cost.  When drafting
    does not pay, k = 0, but every ``probe_every`` plain steps it drafts a
    little anyway so that the estimates can recover when content changes.
    """

    name = "cost"

    def __init__(self, costs: CostModel, k_max: int = 16, probe_every: int = 16, probe_k: int = 2) -> None:
        self.costs = costs
        self.k_max = _check_k(k_max, "k_max")
        self.probe_every = probe_every
        self.probe_k = probe_k
        self._sources: dict[str, _SourceState] = {}
        self._plain_steps = 0
        self._probe_due = False
        self._probe_interval = probe_every
        self._steps = 0
        self._overhead_s = 0.0
        self._ruled: set[str] = set()  # sources that decide token by token (continue_rule)

    def source(self, name: str) -> _SourceState:
        st = self._sources.get(name)
        if st is None:
            st = self._sources[name] = _SourceState(AcceptanceTracker(k_max=self.k_max))
        return st

    def best_k_for(self, name: str) -> int:
        """The source's best k, cached: recomputed after it drafts, or every 16 steps as costs drift.

        Recomputing each step would cost tens of microseconds of Python,
        several percent of a plain step on a small model.
        """
        st = self.source(name)
        if st.best_k is None or self._steps - st.best_k_step >= 16:
            st.best_k = best_k(
                st.acceptance.conditional(),
                lambda k: k * st.per_token_s,
                self._step_cost,
                self.k_max,
            )
            st.best_k_step = self._steps
        return st.best_k

    def _step_cost(self, n: int) -> float:
        """Verifying n tokens plus the loop's per-step overhead (paid once per step, so it favours drafting)."""
        return self.costs.verify_s(n) + self._overhead_s

    def next_k(self) -> int:
        self._probe_due = False
        if not self._sources:
            return self.probe_k  # nothing known yet: a cheap first look
        k = max(self._budget(name) for name in self._sources)
        if k == 0 and self._plain_steps >= self._probe_interval:
            self._probe_due = True
            # Back off while probes keep saying "not worth it": probes cost time too.
            self._probe_interval = min(self._probe_interval * 2, 16 * self.probe_every)
            return self.probe_k
        if k > 0:
            self._probe_interval = self.probe_every
        return k

    def _budget(self, name: str) -> int:
        """k for one source: its best k, or k_max for a source that stops token by token.

        A model drafter consults ``continue_rule`` for every token, with its
        own confidence, so capping it at the k that average acceptance
        suggests would hide the long runs where the draft is sure.
        """
        k = self.best_k_for(name)
        return self.k_max if k > 0 and name in self._ruled else k

    def trim(self, source: str, n: int) -> int:
        if self._probe_due or self.source(source).acceptance.n_observed() < 1.0:
            return min(n, self.probe_k)
        return min(n, self._budget(source))

    def continue_rule(self, source: str) -> Callable[[Sequence[float], float], bool]:
        """For model drafts: keep drafting while one more token raises the expected rate.

        Called by the drafter with the confidences so far (draft probability
        of each drafted token, the last one included) and the draft time spent.
        """
        st = self.source(source)
        self._ruled.add(source)

        def rule(confidences: Sequence[float], draft_s: float) -> bool:
            n = len(confidences)
            st.last_confidences = list(confidences)
            # P(accept token i | tokens < i accepted), learned from this source's own
            # history of (confidence, outcome) pairs: a draft model's confidence is a
            # far better per-token predictor than the average rate at that position.
            cond = st.acceptance.conditional()
            # Deep in a draft, survivors are likelier to be accepted than their confidence
            # alone says, which the position estimate captures: take the larger.
            probs = [max(st.calibration.prob(c), cond[min(i, self.k_max - 1)]) for i, c in enumerate(confidences)]
            e_with = expected_accepted(probs, n)
            e_without = expected_accepted(probs, n - 1)
            next_draft = st.per_token_s if st.calls else 0.0
            rate_with = (1.0 + e_with) / (draft_s + self._step_cost(n + 1))
            rate_without = (1.0 + e_without) / (draft_s - next_draft + self._step_cost(n))
            return n <= self.k_max and rate_with >= rate_without

        return rule

    def observe(self, outcome: StepOutcome) -> None:
        n = outcome.num_drafted
        self._steps += 1
        if outcome.other_s > 0:
            self._overhead_s += 0.05 * (min(outcome.other_s, 4 * self._overhead_s + 1e-4) - self._overhead_s)
        self.costs.observe_verify(n + 1, outcome.verify_s)
        if n == 0:
            self._plain_steps += 1
            return
        self._plain_steps = 0
        st = self.source(outcome.source)
        st.acceptance.update(n, outcome.num_accepted)
        if st.last_confidences:
            st.calibration.update(st.last_confidences[:n], outcome.num_accepted)
            st.last_confidences = []
        per_token = outcome.draft_s / n
        # The first call of a source is a warm-up (buffers, graphs, cold caches: it
        # measured 1000x a normal step here), so it is not used.  After that the
        # update is asymmetric: a model drafter that sat out plain steps first
        # catches up on the tokens it missed, which inflates that one step; such
        # spikes must not convince the policy that drafting is expensive for good.
        if st.calls == 1:
            st.per_token_s = per_token
        elif st.calls > 1:
            alpha = 0.3 if per_token < st.per_token_s else 0.05
            st.per_token_s += alpha * (per_token - st.per_token_s)
        st.calls += 1
        st.best_k = None


POLICIES = ("cost", "fixed", "window", "heuristic")


def make_policy(name: str, k: int, costs: CostModel | None = None, k_max: int | None = None) -> DraftLengthPolicy:
    """Build a policy by its --k-policy name; ``k`` is the fixed/initial budget."""
    if name == "fixed":
        return FixedK(k)
    if name == "window":
        return WindowK(k=max(k, 4), k_max=k_max or 24)
    if name == "heuristic":
        return HeuristicK(k=k, k_max=k_max or 32)
    if name == "cost":
        if costs is None:
            raise InvalidParameterError("the cost policy needs a calibrated cost model")
        return CostK(costs, k_max=k_max or 16)
    raise InvalidParameterError(f"unknown k policy {name!r}; choose one of: {', '.join(POLICIES)}")
