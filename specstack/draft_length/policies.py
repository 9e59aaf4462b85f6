"""Policies that choose the draft budget k before each step.

The policy is the one owner of draft length.  Before each step the engine
asks it for a ``Budget`` (a token cap, whether a tree is allowed, a
token-by-token keep-going rule for model drafts, and ``Advice``: acceptance
by source and verification cost, for drafters that choose between sources)
and hands that value to ``Drafter.propose``.  Once the draft's source is
known, the engine applies the budget's ``cut`` (how much of that source's
draft is worth verifying), and reports each outcome through ``observe``.  A policy sees statistics and costs only,
never a drafter's internals.  k = 0 means a plain decoding step.

With several generations in one step, ``BatchLoad`` tells the policy what
the others already put in the batch, so a draft token is valued at its
marginal cost in that batch: speculation shrinks as load grows.

Policies: ``fixed`` (k = N), ``window`` (the research notes' controller),
``heuristic`` (transformers' +2/-1 schedule) and ``cost`` (the default:
maximise expected committed tokens per second from measured costs).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from ..errors import InvalidParameterError
from .acceptance import AcceptanceBook, ConfidenceCalibration, best_k, expected_accepted
from .budget import DEFAULT_K, DEFAULT_K_MAX, MAX_DRAFT, SOLO, Advice, BatchLoad, Budget, DraftLengthPolicy, Go, KeepGoing, StepOutcome
from .costs import CostModel

if TYPE_CHECKING:
    from ..metrics import GenerationStats


# A look at a scored source (``CostK._worth_looking``) is taken every step only while it costs at most
# this share of a plain step: the suffix drafter's ~30-60 us is 0.2% of a 23 ms step on the 1B stand-in.
LOOK_SHARE = 0.02

# Probes (drafting where it does not pay, to learn whether it has started to) may take at most this share of
# the time spent decoding plainly since the last one, net of what they win back. Counting steps alone let
# a draft model's probes cost 12% of a 96-token generation on the bundled pair (0.87-0.88x plain).
PROBE_SHARE = 0.02

# A model source's asks (a step that calls it) that left no token to verify (``keep_going`` dropped its first, the
# head unsure) still cost the call. The first call is priced at its cost over the share of asks kept, a running
# mean moved this much by each ask: on a third-party prompt where pycoder-6m-mtp's head was unsure (`jinja2.lexer`),
# `mtp@cost` asked on 88 of 94 steps, kept 6 drafts and ran at 0.86x plain, its asks a fifth of the time.
KEPT_WEIGHT = 0.25
KEPT_FLOOR = 0.02

# What a generation keeps of plain decoding's rate whatever a scored source's drafts turn out to be (conservative
# exploration, as in conservative bandits): a scored draft is verified only as far as the time its rows would lose
# were every token refused fits in what the generation has won so far, plus (1 / FLOOR - 1) of the plain decoding
# time its tokens stand for, plus STAKE plain steps. A generation of 50 tokens or more so keeps 0.97x plain decoding's
# rate, as the cost model prices it. Scores are calibrated across requests, and a request can be where they are
# wrong: priced by expectation alone, 12 of 25 third-party completions on Gemma 3 270M lost 3-9% against plain
# decoding (`bench replay`, priced at a 2-core AVX2 EPYC's curve, where a 2-row call costs 1.9x a 1-row one); with
# the floor none fell below 0.97x and the aggregate rose (1.00x to 1.03x), while the grounded edits' references held
# (1.30x, 1.29x). The stake lets a first short draft through: without it, where rows are cheap (t(n) = 1 + 0.1 (n - 1)),
# those copies fell from 4.96x to 4.77x. A model draft is not bounded so: its own confidence prices it token by token,
# and its asks cost a call and a catch-up before any token is known (bounded too, `mtp@cost` on the bundled MTP model
# fell from 1.23x to 1.21x plain, its lowest prompt from 0.98x to 0.95x, `--exact on`, 3 rounds).
FLOOR = 0.98
STAKE = 0.5

# The wager (issue 56): beyond that worst-case bound, a scored draft is verified where it pays at the lower confidence
# bound of its tokens' calibrated acceptance (Wilson, ``WAGER_Z`` standard errors of each bin's decayed counts) and
# what it would lose in expectation at that bound fits in what the project's floor allows a prompt: ``RISK_FLOOR`` of
# plain decoding's rate (never below 0.95x), less what the generation has lost, plus ``WAGER_STAKE`` plain steps.
WAGER_Z = 2.0
RISK_FLOOR = 0.95
WAGER_STAKE = 1.0
# What a copy's evidence is worth before any outcome is seen: a token whose odds of going on are at least
# 1 - 2^-EVIDENCE_TRUSTED (a prompt-lookup match of 30 tokens or more) is accepted at those odds, as EVIDENCE_PRIOR
# observations would say. Measured over 14 Gemma 3 270M requests at fixed k 16 (prompt lookup, `bench replay`), the
# target accepted 80-90% of the drafted tokens after matches of 20 tokens or more and refused none at the first
# token, but 44-62% after 6-19 and 10-28% after shorter ones, so shorter matches start untrusted and earn their
# trust from outcomes (a prior of 32 from 14 tokens up let 6 of 50 third-party completions fall below 0.97x plain).
EVIDENCE_TRUSTED = 5
EVIDENCE_PRIOR = 32.0

# How many more tokens a model draft looks ahead when deciding whether to draft the next: where exact call shapes
# pad a verification (t(2) = t(3) on the bundled MTP model), one more row can cost more than two.
LOOKAHEAD = 4
# Context tokens per step of the depth the cost policy's caches are keyed by (``_depth_bucket``).
DEPTH_BUCKET = 64


def _depth_bucket(depth: int | None) -> int | None:
    """A context depth as the cost policy's caches key it: a row's attention moves slowly with depth, and a key
    that changed every token would price every step afresh (``CostK._cached``)."""
    return None if depth is None else depth // DEPTH_BUCKET


def token_odds(scores: Sequence[float]) -> list[float]:
    """A scored draft's path scores (P(the first i tokens are right)) as each token's own odds of going on: score i
    over score i - 1 (a copy after a match of m tokens: Laplace's 1 - 1/(m + 2) at every token)."""
    out, before = [], 1.0
    for s in scores:
        out.append(min(1.0, s / before) if before > 0 else 0.0)
        before = s
    return out


def check_k(k: int, what: str = "k") -> int:
    """A draft length (``k``, ``k_max``) checked: the one place it is, for every policy, command and request.
    At least 1 (0 is plain decoding: ``--drafter none``), at most ``MAX_DRAFT``."""
    if k < 1:  # k_max 0 once silently meant "the default"
        raise InvalidParameterError(f"{what} must be at least 1 (got {k}); use --drafter none for plain decoding")
    if k > MAX_DRAFT:
        raise InvalidParameterError(f"{what} must be at most {MAX_DRAFT} (got {k}): a verification batch holds the "
                                    f"pending token and at most {MAX_DRAFT} draft tokens")
    return k


_PLAIN = Budget(0)


class _Policy:
    """Shared parts: the acceptance book (every policy keeps one) and a cap on k."""

    name = "policy"
    costs: CostModel | None = None
    # How much of the acceptance learnt so far a new generation starts from (``fork``): a quarter, so that its own
    # first outcomes outweigh it. A model draft's acceptance differs by prompt (the bundled pair, fixed k 4: 95% on
    # one completion, 24% on another), and carried whole, whatever the first generations learnt held for the rest:
    # `draft-model@cost` on 8 third-party completions ran at 1.00x plain in one run (it had learnt "never") and
    # 1.11x in the next, against 1.15x and 1.14x at a quarter; prompt lookup's runs were unchanged on the bundled
    # pair (1.82x) and on Gemma 3 270M.
    fork_weight = 0.25

    def __init__(self, k_max: int = 32) -> None:
        self.book = AcceptanceBook(k_max)

    def _advice(self) -> Advice:
        return Advice(self.book)

    def fork(self) -> "_Policy":
        """A policy for one generation: its own acceptance statistics (content differs between
        generations), starting from this one's at ``fork_weight``; costs and draft-cost estimates stay shared."""
        child = copy.copy(self)
        child.book = self.book.copy(self.fork_weight)
        child._reset_generation()
        return child

    def adopt(self, child: "_Policy") -> None:
        """A generation ended: what it learnt about acceptance is the prior for the next one."""
        self.book = child.book.copy()

    def _reset_generation(self) -> None:
        """Per-generation state of a forked policy (none here)."""

    def expect_scores(self, sources: frozenset[str]) -> None:
        """Sources that score their drafts: only the cost policy reads scores (``CostK._worth_scored``)."""

    def _learn(self, outcome: StepOutcome) -> None:
        if outcome.n_drafted:
            self.book.update(outcome.source, outcome.n_drafted, outcome.n_accepted)

    def why_idle(self, stats: GenerationStats) -> str:
        """Why a generation (``stats``) drafted nothing, in words: here, only whether the drafter proposed anything
        (a fixed-k policy verifies whatever it is given); the cost policy says what it weighed."""
        if stats.n_proposed == 0:
            return (f"{stats.drafter} proposed no draft in {stats.n_steps} steps: nothing in the prompt or output "
                    "matched what it drafts from")
        return f"every draft {stats.drafter} proposed ({stats.n_proposed} tokens) was cut to nothing"




class FixedK(_Policy):
    """Always ask for k tokens (the user's habit, and llama.cpp's --draft-max)."""

    name = "fixed"

    def __init__(self, k: int = DEFAULT_K) -> None:
        super().__init__()
        self.k = check_k(k)

    def budget(self, cap: int, load: BatchLoad = SOLO, tree: bool = False) -> Budget:
        return Budget(min(self.k, cap), tree, None, self._advice())

    def observe(self, outcome: StepOutcome) -> None:
        self._learn(outcome)


class WindowK(_Policy):
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
        super().__init__(k_max)
        self.k_min, self.k_max, self.window = k_min, k_max, window
        self.high, self.low, self.step = high, low, step
        self.k = min(max(k, k_min), k_max)
        self._drafted = 0
        self._accepted = 0

    def budget(self, cap: int, load: BatchLoad = SOLO, tree: bool = False) -> Budget:
        return Budget(min(self.k, cap), tree, None, self._advice())

    def observe(self, outcome: StepOutcome) -> None:
        self._learn(outcome)
        self._drafted += outcome.n_drafted
        self._accepted += outcome.n_accepted
        if self._drafted < self.window:
            return
        rate = self._accepted / self._drafted
        if rate > self.high:
            self.k = min(self.k + self.step, self.k_max)
        elif rate < self.low:
            self.k = max(self.k - self.step, self.k_min)
        self._drafted = self._accepted = 0


class HeuristicK(_Policy):
    """transformers' "heuristic" schedule: +2 when every draft token was accepted, else -1."""

    name = "heuristic"

    def __init__(self, k: int = 4, k_min: int = 1, k_max: int = 32) -> None:
        super().__init__(k_max)
        self.k_min, self.k_max = k_min, k_max
        self.k = min(max(check_k(k), k_min), k_max)

    def budget(self, cap: int, load: BatchLoad = SOLO, tree: bool = False) -> Budget:
        return Budget(min(self.k, cap), tree, None, self._advice())

    def observe(self, outcome: StepOutcome) -> None:
        self._learn(outcome)
        if outcome.n_drafted == 0:
            return
        if outcome.n_accepted == outcome.n_drafted:
            self.k = min(self.k + 2, self.k_max)
        else:
            self.k = max(self.k - 1, self.k_min)


@dataclass
class _Looks:
    """What a look at the scored sources costs: a running mean of draft time over steps that looked."""

    seconds: float = 0.0
    n: int = 0

    def observe(self, draft_s: float) -> None:
        self.n += 1
        if self.n > 1:  # the first call is a warm-up
            self.seconds += (draft_s - self.seconds) / min(self.n - 1, 20)


@dataclass
class _Mean:
    """A running mean of a cost in seconds: the first sample sets it, then each moves it 15%, clipped to 3x it.

    The first call counts: a draft model's context is warmed up at load (its first call had measured 1000x a
    normal step, so it used to be skipped, and until a second call drafting was priced as free: a lucky first
    look then had a 96-token `generate` drafting long on a pair where drafting never pays). The clip: a model
    drafter that sat out plain steps catches up on the tokens it missed in its next call (one batch), a spike
    that must not dominate.  An asymmetric update (fast down, slow up) underestimated pycoder-1m's cost by ~2x
    here, so the policy drafted where it did not pay.
    """

    seconds: float = 0.0
    n: int = 0

    def observe(self, x: float) -> None:
        self.seconds = x if self.n == 0 else self.seconds + 0.15 * (min(x, 3.0 * self.seconds) - self.seconds)
        self.n += 1


@dataclass
class _SourceState:
    calibration: ConfidenceCalibration = field(default_factory=ConfidenceCalibration)
    # A retrieval draft's scores (``Draft.scores``) mapped to acceptance; starts by believing them.
    scores: ConfidenceCalibration = field(default_factory=lambda: ConfidenceCalibration(trusting=True))
    # The same outcomes keyed by each token's own odds of going on (its score over the one before: a match's
    # length, a continuation's count), which the wager's lower bounds read (``CostK._wager``).  Its bins start
    # trusting that odds only from ``EVIDENCE_TRUSTED`` up, as ``EVIDENCE_PRIOR`` observations: at 1/2 below it
    evidence: ConfidenceCalibration = field(default_factory=lambda: ConfidenceCalibration(
        bins=12, odds=True, trusting=True, prior=EVIDENCE_PRIOR, trust_from=EVIDENCE_TRUSTED))
    per_token: _Mean = field(default_factory=_Mean)  # a step's draft time per token drafted (a model: per call)
    # A model draft's calls, timed by ``keep_going``: the first (it also catches up on the tokens the target
    # committed since the last draft, in a bigger batch) and each chained one after it. On the bundled MTP model
    # the first took 1.0 ms and the chained ones 0.5 ms (`-t 1`); priced alike, a draft stopped at one token.
    first: _Mean = field(default_factory=_Mean)
    chained: _Mean = field(default_factory=_Mean)

    def draft_s(self, k: int, kept: float = 1.0) -> float:
        """What drafting k tokens costs, as measured so far (nothing measured: free, so the first look is taken),
        the first call's cost over ``kept``, the share of asks that leave a token to verify (``KEPT_WEIGHT``)."""
        if k <= 0:
            return 0.0
        first = self.first.seconds if self.first.n and self.chained.n else self.per_token.seconds
        unkept = first * (1.0 / max(kept, KEPT_FLOOR) - 1.0)
        if self.first.n and self.chained.n:
            return unkept + self.first.seconds + (k - 1) * self.chained.seconds
        return unkept + k * self.per_token.seconds

    def next_call_s(self) -> float:
        """One more chained draft call."""
        return self.chained.seconds if self.chained.n else self.per_token.seconds


class CostK(_Policy):
    """Pick the k that maximises expected committed tokens per second (the default policy).

    Expected tokens come from per-source acceptance by position; costs come
    from the target's measured call curve t(n) (calibrated at load, refined
    online), priced through the target's exact call plan, and each source's
    measured draft cost.  With other generations in the step, the rate is
    the whole step's: (their tokens + this one's) / (step cost with this
    draft), so a draft token pays only its marginal cost in that batch.
    When drafting does not pay, k = 0, but every ``probe_every`` plain steps
    it drafts a little anyway so that the estimates can recover.  Whatever
    a scored source's calibration says, a generation keeps ``floor`` of plain
    decoding's rate (``FLOOR``, ``_affordable``): what its scored drafts may
    lose is bounded by what it has won; ``floor`` 0 turns the bound off.  Beyond that bound, ``wager`` verifies
    a scored draft that pays at the lower confidence bound of its evidence, within the risk the project's floor
    allows a prompt (``_wager``, ``RISK_FLOOR``).
    """

    name = "cost"

    def __init__(self, costs: CostModel, k_max: int = DEFAULT_K_MAX, probe_every: int = 16, probe_k: int = 2,
                 floor: float = FLOOR, wager: bool = True) -> None:
        super().__init__(check_k(k_max, "k_max"))
        if not 0.0 <= floor < 1.0:
            raise InvalidParameterError(f"the cost policy's floor is a share of plain decoding's rate in [0, 1) "
                                        f"(got {floor}); 0 turns it off")
        self.floor = floor
        self.wager = wager and floor > 0  # beyond the worst-case bound, the wager (``_wager``); without a floor, moot
        self.costs = costs
        self.k_max = k_max
        self.probe_every = probe_every
        self.probe_k = probe_k
        self._sources: dict[str, _SourceState] = {}
        self._plain_steps = 0
        self._probe_interval = probe_every
        self._plain_s = 0.0  # time in plain steps since the last probe
        self._probe_cost_s = 0.0  # what a probe costs beyond the plain steps it stands for (0: not measured yet)
        self._probing = False  # this step's budget is a probe
        self._steps = 0
        self._overhead_s = 0.0
        self._ruled: set[str] = set()  # sources that decide token by token (keep_going)
        self._scored: set[str] = set()  # sources whose drafts score each token (suffix, REST): cut by the scores
        self._looks = _Looks()  # shared by every generation's fork: what a look at a scored source costs
        self._best: dict[tuple, tuple[int, int]] = {}  # (source, load) -> (best k, step computed)
        self._confidences: dict[str, list[float]] = {}  # the last draft's, per source, for calibration
        self._scores: dict[str, list[float]] = {}  # the last verified scored draft's, per source, for calibration
        self._declined: tuple[str, float] | None = None  # this step's scored draft cut to nothing: source, 1st score
        self._looked = False  # this step's budget was a look (see ``_worth_looking``)
        self._spent: tuple[str, int, float] = ("", 0, 0.0)  # keep_going's last call: source, tokens, seconds
        self._memo: dict[tuple[int, BatchLoad], float] = {}  # ``_step_cost`` until the next ``observe``
        self._kept: dict[str, float] = {}  # per model source: the share of its asks kept (``KEPT_WEIGHT``)
        # Model sources passed over in drafting steps (``_idle_models``): steps and time since they were last asked,
        # the probe interval's back-off, whether this step skips them, and the ones this step probes.
        self._idle_steps, self._idle_s, self._idle_interval = 0, 0.0, probe_every
        self._skipping = False
        self._probing_idle: frozenset[str] = frozenset()
        self._expected: frozenset[str] = frozenset()  # this generation's drafter's scored sources (``expect_scores``)
        self._margin_s = 0.0  # this generation's time won over plain decoding, plus the floor's share (``_affordable``)
        self._load = SOLO  # the load this step's budget was priced at (``_note_margin``)
        self._afford: int | None = None  # ``_affordable``, for this step
        # Of this generation's drafts cut to nothing: the best first-token acceptance estimated, and how many of
        # them would have been verified but for the floor (``why_idle``)
        self._declined_p, self._floor_held = 0.0, 0
        self._tokens = 0  # tokens this generation has committed (``_risk_room``)

    def _reset_generation(self) -> None:
        self._margin_s, self._load, self._afford = 0.0, SOLO, None
        self._declined_p, self._floor_held = 0.0, 0
        self._tokens = 0  # tokens this generation has committed (``_risk_room``)
        self._best = {}
        self._confidences = {}
        self._scores = {}
        self._memo = {}
        # A new prompt may suit the source better: what the last ones learnt counts at ``fork_weight``.
        self._kept = {name: 1.0 - self.fork_weight * (1.0 - q) for name, q in self._kept.items()}

    def adopt(self, child: "_Policy") -> None:
        """Acceptance, probe back-off and overhead carry over to later generations (draft costs are shared)."""
        super().adopt(child)
        if isinstance(child, CostK):
            self._plain_steps, self._probe_interval = child._plain_steps, child._probe_interval
            self._plain_s, self._probe_cost_s = child._plain_s, child._probe_cost_s
            self._overhead_s, self._steps = child._overhead_s, child._steps
            self._kept = dict(child._kept)
            self._best = {}

    def source(self, name: str) -> _SourceState:
        st = self._sources.get(name)
        if st is None:
            st = self._sources[name] = _SourceState()
        return st

    def best_k_for(self, name: str, load: BatchLoad = SOLO) -> int:
        """The source's best k under ``load``, cached: recomputed after it drafts, or every 16 steps.

        Recomputing each step would cost tens of microseconds of Python,
        several percent of a plain step on a small model.
        """
        st = self.source(name)
        kept = self._kept.get(name, 1.0)
        return self._cached((name, load), lambda: best_k(self.book.conditional(name), lambda k: st.draft_s(k, kept),
                                                        lambda n: self._step_cost(n, load), self.k_max, load.tokens))

    def _cached(self, key: tuple, compute: Callable[[], int]) -> int:
        """A k computed at most every 16 steps per key (``best_k_for``'s cache; the load in ``key`` by value)."""
        *head, load = key
        key = (*head, tuple(sorted(load.rows)), round(load.tokens, 1), load.free_rows, round(load.displaced_s, 4),
               _depth_bucket(load.depth), tuple(_depth_bucket(d) for d in load.depths))
        hit = self._best.get(key)
        if hit is None or self._steps - hit[1] >= 16:
            hit = (compute(), self._steps)
            if len(self._best) > 256:
                self._best.clear()
            self._best[key] = hit
        return hit[0]

    def _step_cost(self, n: int, load: BatchLoad = SOLO) -> float:
        """The step with this generation verifying n rows, plus the loop's per-step overhead, plus the prompt
        tokens its n - 1 draft rows push out of the step (``BatchLoad.displacement_s``).

        Memoised until the step is observed (costs and overhead move only then): a drafted step priced ~23
        sizes (best k, the cut, ``keep_going``'s look-ahead), ~5% of a step on the bundled MTP model.
        """
        key = (n, load)
        cost = self._memo.get(key)
        if cost is None:
            cost = self._memo[key] = (self.costs.batch_s(load.rows + (n,), load.all_depths()) + self._overhead_s
                                      + load.displacement_s(n - 1))
        return cost

    def budget(self, cap: int, load: BatchLoad = SOLO, tree: bool = False) -> Budget:
        self._looked = self._probing = self._skipping = False
        self._probing_idle = frozenset()
        self._load, self._afford = load, None
        if not self._sources:
            return self._probe(cap, load, tree)  # nothing known yet: a cheap first look
        # A scored source this generation's drafter has is priced before its first draft (``expect_scores``): a
        # cascade whose model source drafted first, and badly, never asked its retrieval source again.
        names = self._expected.union(self._sources) if self._expected else self._sources
        k = max(self._k_for(name, load) for name in names)
        looking = self._worth_looking(load)
        if looking:  # a scored source is asked for its longest draft every step; its scores decide what is verified
            k = self.k_max
        skip, probing = frozenset(), False
        if k > 0:  # a model source beside another (a cascade's) is asked only where its own pricing says it pays
            unscored = self._unscored()
            skip, probing = self._idle_models(unscored, load)
            self._looked = looking and unscored <= skip
        if k == 0:
            if self._plain_steps >= self._probe_interval and self._plain_s * PROBE_SHARE >= self._probe_cost_s:
                # Back off while probes keep saying "not worth it": probes cost time too.
                self._probe_interval = min(self._probe_interval * 2, 64 * self.probe_every)
                self._plain_steps, self._plain_s = 0, 0.0
                return self._probe(cap, load, tree)
            return _PLAIN  # the common case when drafting does not pay: keep it cheap
        self._probe_interval = self.probe_every
        keep = self._keep_going(load)
        advice = Advice(self.book, lambda n: self._step_cost(n, load))
        k = min(k, cap)
        likely = max(min(k, self.best_k_for(name, load)) for name in self._sources)  # a model draft stops early
        expected = 1.0 + max(expected_accepted(self.book.conditional(name), likely) for name in self._sources)
        return Budget(k, tree, keep, advice, self._cut(load, probing), expected, 1 + likely, probe=probing,
                      skip=skip)

    def expect_scores(self, sources: frozenset[str]) -> None:
        """This generation's drafter has these scored sources: they are priced, and looked at, from its first step,
        whatever sources beside them have drafted (``_scored`` is shared by every fork, as ``_looks`` is)."""
        self._expected = frozenset(sources)
        self._scored.update(sources)

    def _unscored(self) -> frozenset[str]:
        """The sources seen that draft without scores (models, ruled token by token)."""
        return frozenset(name for name in self._sources if name not in self._scored)

    def _idle_models(self, unscored: frozenset[str], load: BatchLoad) -> tuple[frozenset[str], bool]:
        """In a step that drafts: the model sources (of ``unscored``) not to ask (their best k is 0), and whether this
        step asks them anyway, as a probe.

        A cascade asks its model source wherever the one before it comes up short, nearly every step outside a
        copy: asked so, `cascade:suffix,mtp` paid a head call on most steps, and the look that lets suffix verify a
        copy was off for the whole cascade (it ran at 1.09-1.11x plain on the bundled MTP model's third-party
        completions, suffix alone 1.37-1.39x). Skipped model sources are probed as a plain run's would be: after
        ``_idle_interval`` skipped steps, within ``PROBE_SHARE`` of their time, backing off while probes say no.
        """
        idle = frozenset(name for name in unscored if self._k_for(name, load) == 0)
        if not idle:
            self._idle_steps, self._idle_s = 0, 0.0
            return idle, False
        if self._idle_steps >= self._idle_interval and self._idle_s * PROBE_SHARE >= self._probe_cost_s:
            self._idle_interval = min(self._idle_interval * 2, 64 * self.probe_every)
            self._idle_steps, self._idle_s = 0, 0.0
            self._probing_idle = idle
            return frozenset(), True
        self._skipping = True
        return idle, False

    def _cut(self, load: BatchLoad, probing: bool = False) -> Callable[[str, int, Sequence[float] | None], int]:
        """The budget's ``cut``: a scored draft by its scores, else by the source's acceptance by position."""

        def cut(source: str, n: int, scores: Sequence[float] | None = None) -> int:
            if scores is not None:
                return self._worth_scored(source, scores, load)
            if probing or self.book.tracker(source).n_observed() < 1.0:
                return min(n, self.probe_k)
            if source in self._ruled:
                return self._k_for(source, load)
            return self._worth_verifying(source, n, load)

        return cut

    def _worth_looking(self, load: BatchLoad) -> bool:
        """Ask the scored sources for a draft even when average acceptance says none pays?

        Yes when a source scores its tokens (``Draft.scores``) and a look costs under ``LOOK_SHARE`` of a
        plain step; a model source beside it is asked only where its own k pays (``_idle_models``).  Average
        acceptance cannot tell a continuation seen many times (a repeated request, a copied block) from a
        guess, so it prices both alike; on the 1B stand-in,
        where a 2-row call costs 2.4x a 1-row one, it kept the suffix drafter at k = 0 and decoded a
        prompt the global tree had seen twice at 45 tok/s where fixed k = 16 ran it at 87 tok/s.
        """
        if not self._scored:
            return False
        return self._looks.seconds <= LOOK_SHARE * self._step_cost(1, load)

    def _worth_scored(self, name: str, scores: Sequence[float], load: BatchLoad) -> int:
        """Of a scored draft, the prefix whose verification raises the expected rate most, its tokens'
        acceptance read off their scores through the source's calibration (learnt from outcomes)."""
        self._scored.add(name)
        st = self.source(name)
        probs = [st.scores.prob(c) for c in scores]
        # The best prefix within the floor: a long draft cut to what the floor affords may no longer pay.
        m = best_k(probs, lambda k: 0.0, lambda n: self._step_cost(n, load), min(len(probs), self._affordable()),
                   load.tokens)
        if m < len(probs) and self.wager:
            m = max(m, self._wager(st, scores, load))
        self._scores[name] = list(scores[:m])  # calibrated against the outcome in ``observe``
        self._declined = (name, scores[0]) if m == 0 and scores else None  # calibrated by the plain step's token
        if m == 0 and probs:
            self._note_declined(probs, load)
        return m

    def _wager(self, st: _SourceState, scores: Sequence[float], load: BatchLoad) -> int:
        """The longest prefix of a scored draft worth verifying at the lower bound of its acceptance (``WAGER_Z``)
        whose expected loss at that bound fits in the risk the floor allows (``_risk_room``); 0 where none does.

        Verbatim evidence decides here from a generation's first step: a copy the calibration has seen accepted
        hundreds of times has a lower bound near its rate, so it is verified at once, where the worst-case bound
        (``_affordable``) waited for the generation to win a refused draft's price first (a 160-token grounded
        edit on Gemma 3 270M drafted 88 of its tokens, llama.cpp's ngram-map-k4v 133-160)."""
        lower = [st.evidence.lower(c, WAGER_Z) for c in token_odds(scores)]
        cost = lambda n: self._step_cost(n, load)  # noqa: E731
        k = best_k(lower, lambda k: 0.0, cost, len(lower), load.tokens)
        room = self._risk_room(load)
        while k > 0 and self._expected_loss(lower, k, load) > room:
            k -= 1
        return k if k == 0 or best_k(lower[:k], lambda j: 0.0, cost, k, load.tokens) == k else 0

    def _expected_loss(self, lower: Sequence[float], k: int, load: BatchLoad) -> float:
        """What verifying k draft tokens loses against plain decoding in expectation, were each token accepted at its
        lower bound: the step's cost less the plain steps of the tokens it commits, where that is positive."""
        plain, step = self._step_cost(1, load), self._step_cost(k + 1, load)
        loss, reach = 0.0, 1.0
        for j in range(k + 1):
            stop = reach * (1.0 - lower[j]) if j < k else reach  # exactly j accepted
            loss += stop * max(0.0, step - (j + 1) * plain)
            if j < k:
                reach *= lower[j]
        return loss

    def _risk_room(self, load: BatchLoad) -> float:
        """The loss a generation may still risk: ``RISK_FLOOR`` of plain decoding's rate over the tokens it has
        committed (its margin, kept at ``FLOOR``, plus the difference), and ``WAGER_STAKE`` plain steps."""
        plain = self._step_cost(1, load)
        tokens = self._tokens
        return self._margin_s + (1.0 / RISK_FLOOR - 1.0 / self.floor) * tokens * plain + WAGER_STAKE * plain

    def _note_declined(self, probs: Sequence[float], load: BatchLoad) -> None:
        """A scored draft cut to nothing: its first token's estimate, and whether the floor alone cut it (the
        best prefix without it would be verified), for ``why_idle``."""
        self._declined_p = max(self._declined_p, probs[0])
        if self._affordable() < len(probs) and best_k(probs, lambda k: 0.0, lambda n: self._step_cost(n, load),
                                                       len(probs), load.tokens) > 0:
            self._floor_held += 1

    def _worth_verifying(self, name: str, n: int, load: BatchLoad) -> int:
        """Of a draft that came back with ``n`` tokens, the prefix whose verification raises the expected rate most.

        The budget planned for the source's best k; a retrieval drafter often finds fewer.  Drafting is paid
        by then, so only verification counts, and a short draft can be worth none of it: where a 2-row call
        costs 2.4x a 1-row one (the 1B stand-in, Q4_K_M), verifying one drafted token loses whatever its
        acceptance.  Cached as ``best_k_for`` is.
        """
        n = min(n, self.k_max)
        return self._cached(("cut", name, n, load), lambda: best_k(self.book.conditional(name), lambda k: 0.0,
                                                                   lambda m: self._step_cost(m, load), n, load.tokens))

    def why_idle(self, stats: GenerationStats) -> str:
        """Why a generation drafted nothing under the cost policy: what a verified row costs here against a plain
        step, what acceptance its drafts were expected to have, and whether the floor held them back."""
        plain, two = self._step_cost(1), self._step_cost(2)
        rows = f"a verified row costs {two / plain - 1:.2f}x a plain step here (t(2) {1e3 * two:.1f} ms, t(1) " \
               f"{1e3 * plain:.1f} ms)"
        if stats.n_proposed == 0:
            known = [self.book.conditional(n)[0] for n in self._sources if self.book.tracker(n).n_observed() >= 1.0]
            seen = f"; acceptance so far {100 * max(known):.0f}% at the first position" if known else ""
            return (f"the cost policy asked {stats.drafter} for no draft that would pay ({rows}{seen}), or "
                    f"{stats.drafter} found nothing to draft")
        said = (f"the cost policy declined all {stats.n_declined} drafts {stats.drafter} proposed "
                f"({stats.n_proposed} tokens): {rows}")
        if self._declined_p > 0:
            said += f", and their first tokens were expected to be accepted {100 * self._declined_p:.0f}% at best"
        if self._floor_held:
            said += (f"; {self._floor_held} of them would have paid on average, but the floor (never below "
                     f"{100 * self.floor:.0f}% of plain decoding's rate) held them back until the generation had "
                     "won enough to cover a refused draft")
        return said

    def _affordable(self) -> int:
        """The most tokens of a scored draft this step may verify within the floor (``FLOOR``): what their rows
        cost beyond a plain step, were every one refused, fits in the generation's margin plus ``STAKE`` plain
        steps and the floor's share of this one. Every step moves the margin (``_note_margin``), whichever source
        drafted it: what a model draft wins in a cascade lets its scored source draft longer."""
        if not self.floor:
            return self.k_max
        if self._afford is None:  # priced at this step's load (``budget``)
            load, m = self._load, 0
            plain = self._step_cost(1, load)
            room = self._margin_s + (1.0 / self.floor - 1.0 + STAKE) * plain
            if self._step_cost(self.k_max + 1, load) - plain <= room:  # a generation that has won: one price
                m = self.k_max
            while m < self.k_max and self._step_cost(m + 2, load) - plain <= room:
                m += 1
            self._afford = m
        return self._afford

    def _note_margin(self, outcome: StepOutcome) -> None:
        """The margin moves by the plain decoding time of the step's tokens over the floor, less the step's rows
        and drafting, priced by the cost model (a measured step's noise would move it more than the draft did) at
        the load the budget saw, before ``observe`` clears the memo."""
        if not self.floor or not self._scored:  # no scored source: nothing reads the margin
            return
        plain = self._step_cost(1, self._load)
        tokens = 1 + outcome.n_accepted
        spent = self._step_cost(1 + outcome.n_drafted, self._load) + outcome.draft_s
        self._margin_s += tokens * plain / self.floor - spent
        self._tokens += tokens

    def _probe(self, cap: int, load: BatchLoad, tree: bool) -> Budget:
        self._probing = True
        advice = Advice(self.book, lambda n: self._step_cost(n, load))
        return Budget(min(self.probe_k, cap), tree, self._keep_going(load), advice, self._cut(load, probing=True),
                      probe=True)

    def _k_for(self, name: str, load: BatchLoad) -> int:
        """k for one source: its best k, or k_max for a source that stops token by token.

        A model drafter consults ``keep_going`` for every token, with its own
        confidence, so capping it at the k that average acceptance suggests
        would hide the long runs where the draft is sure.
        """
        k = self.best_k_for(name, load)
        return self.k_max if k > 0 and name in self._ruled else k

    def _keep_going(self, load: BatchLoad) -> KeepGoing:
        """For model drafts, after each token: keep it while verifying it raises the expected rate, and draft
        another while one more call and row (within ``LOOKAHEAD`` tokens) would raise it further.

        The call that drafted the token is spent whatever the answer, so it weighs on neither side of the first
        question; the second prices the next call at the source's measured cost per drafted token, and the
        tokens beyond at their acceptance by position, before their confidence is known.
        """

        def rule(source: str, confidences: Sequence[float], draft_s: float) -> Go:
            st = self.source(source)
            self._ruled.add(source)
            n = len(confidences)
            self._confidences[source] = list(confidences)
            if n == 1:
                st.first.observe(draft_s)
            elif n == self._spent[1] + 1 and self._spent[0] == source:
                st.chained.observe(draft_s - self._spent[2])
            self._spent = (source, n, draft_s)
            if n > self.k_max:
                return Go.DROP
            # P(accept token i | tokens < i accepted), learned from this source's own
            # history of (confidence, outcome) pairs: a draft model's confidence is a
            # far better per-token predictor than the average rate at that position.
            cond = self.book.conditional(source)
            # Deep in a draft, survivors are likelier to be accepted than their confidence
            # alone says, which the position estimate captures: take the larger.
            probs = [max(st.calibration.prob(c), cond[min(i, self.k_max - 1)]) for i, c in enumerate(confidences)]
            base = load.tokens + 1.0
            rate_with = (base + expected_accepted(probs, n)) / (draft_s + self._step_cost(n + 1, load))
            rate_without = (base + expected_accepted(probs, n - 1)) / (draft_s + self._step_cost(n, load))
            if rate_with < rate_without:
                return Go.DROP
            call = st.next_call_s()
            for m in range(1, min(LOOKAHEAD, self.k_max - n) + 1):
                probs.append(cond[min(n + m - 1, self.k_max - 1)])
                rate_more = (base + expected_accepted(probs, n + m)) / (draft_s + m * call + self._step_cost(n + m + 1, load))
                if rate_more >= rate_with:
                    return Go.MORE
            return Go.LAST

        return rule

    def _note_probe(self, outcome: StepOutcome) -> None:
        """What the probe cost beyond the plain steps its committed tokens would have taken (a running mean)."""
        plain = self._step_cost(1)
        net = outcome.draft_s + outcome.verify_s + outcome.other_s - (1 + outcome.n_accepted) * plain
        self._probe_cost_s += 0.5 * (max(net, 0.0) - self._probe_cost_s)

    def _note_idle(self, outcome: StepOutcome) -> None:
        """A step that skipped the idle model sources counts toward their next probe; a step that probed them is
        priced as a probe where one of them drafted it (a copy the scored source drafted says nothing of them)."""
        if self._skipping:
            self._skipping = False
            self._idle_steps += 1
            self._idle_s += outcome.draft_s + outcome.verify_s + outcome.other_s
        elif self._probing_idle:
            if outcome.source in self._probing_idle:
                self._note_probe(outcome)
            self._probing_idle = frozenset()

    def _note_kept(self, source: str, kept: bool) -> None:
        """A model source was asked: whether its draft left a token to verify. Its best k is recomputed at once
        (``best_k_for`` caches it for 16 steps), so a run of dropped asks stops asking within a few steps."""
        q = self._kept.get(source, 1.0)
        self._kept[source] = q + KEPT_WEIGHT * ((1.0 if kept else 0.0) - q)
        self._best.clear()

    def observe(self, outcome: StepOutcome) -> None:
        n = outcome.n_drafted
        self._steps += 1
        self._note_margin(outcome)
        self._memo.clear()
        # This step's model draft (``keep_going``'s record): every token it drafted, kept or not, cost a call.
        confidences = self._confidences.pop(outcome.source, None)
        computed = max(n, len(confidences or ()))
        if self._looked:
            self._looks.observe(outcome.draft_s)
            self._looked = False
        if outcome.other_s > 0:
            self._overhead_s += 0.05 * (min(outcome.other_s, 4 * self._overhead_s + 1e-4) - self._overhead_s)
        if self._probing:
            self._probing = False
            self._note_probe(outcome)
        self._note_idle(outcome)
        declined, self._declined = self._declined, None
        if n == 0:
            if declined is not None and outcome.shadow >= 0:
                self.source(declined[0]).scores.update(declined[1:], outcome.shadow)
                self.source(declined[0]).evidence.update(declined[1:], outcome.shadow)
            self._plain_steps += 1
            self._plain_s += outcome.verify_s + outcome.other_s
            if computed:  # a model draft whose every token was dropped: its calls were paid
                self.source(outcome.source).per_token.observe(outcome.draft_s / computed)
                self._note_kept(outcome.source, False)
            return
        self._plain_steps = 0
        self._learn(outcome)
        st = self.source(outcome.source)
        if confidences:
            st.calibration.update(confidences[:n], outcome.n_accepted)
            self._note_kept(outcome.source, True)
        scores = self._scores.pop(outcome.source, None)
        if scores:
            st.scores.update(scores[:n], outcome.n_accepted)
            st.evidence.update(token_odds(scores[:n]), outcome.n_accepted)
        st.per_token.observe(outcome.draft_s / computed)
        self._best.clear()



POLICIES = ("cost", "fixed", "window", "heuristic")


def make_policy(name: str, k: int, costs: CostModel | None = None, k_max: int | None = None) -> DraftLengthPolicy:
    """Build a policy by its --k-policy name; ``k`` is the fixed/initial budget (unused by ``cost``).

    The one way every command and the server build a policy; ``cost`` prices with ``costs``, the target's
    measured t(n) (``calibration``; ``loading.build_policy`` calibrates a target for it).
    """
    check_k(k)
    if k_max is not None:
        check_k(k_max, "k_max")
    if name == "fixed":
        return FixedK(k)
    if name == "window":
        return WindowK(k=max(k, 4), k_max=k_max or 24)
    if name == "heuristic":
        return HeuristicK(k=k, k_max=k_max or 32)
    if name == "cost":
        if costs is None:
            raise InvalidParameterError("the cost policy needs a calibrated cost model (or a target to calibrate)")
        return CostK(costs, k_max=k_max or DEFAULT_K_MAX)
    raise InvalidParameterError(f"unknown k policy {name!r}; choose one of: {', '.join(POLICIES)}")
