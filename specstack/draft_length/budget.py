"""What a draft-length policy hands a drafter and learns from, without the policies themselves.

``Budget`` (with ``Advice``) is the policy's decision for one draft,
``BatchLoad`` what the other generations already put in the step,
``StepOutcome`` what the policy learns after verification, and
``DraftLengthPolicy`` the protocol the engine drives.  The policies are in
``draft_length``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from .acceptance import AcceptanceBook
from .costs import CostModel
from ..errors import InvalidParameterError

if TYPE_CHECKING:
    from ..types import Draft

# Relative verification cost t(n)/t(1) = 1 + VERIFY_SLOPE * (n - 1) for policies
# without a measured curve: 0.2 per token on pycoder-6m and 0.1 on a 1B model with
# 2 cores here (t(17) = 1.28 vs t(2) = 0.32 ms; 142 vs 67 ms).
VERIFY_SLOPE = 0.15

# Verification batches stay within 63 tokens (the pending token and at most 62 drafted): with flash
# attention on, llama.cpp switches kernels at 64 query rows (see docs/exactness.md).
MAX_DRAFT = 62
DEFAULT_K_MAX = 16  # the cost policy's default upper bound on k (--k-max)
DEFAULT_K = 4  # a fixed policy's k (-k), the engine's default policy's


def slope_cost(n: int) -> float:
    return 1.0 + VERIFY_SLOPE * max(0, n - 1)


class Go(IntEnum):
    """A model drafter's question after each token it drafts, answered (``KeepGoing``).

    Two decisions, because the call that drafted the token is paid either way: whether verifying it raises
    the expected rate (else ``DROP``), and whether one more draft call would (else ``LAST``). One answer for
    both charged that sunk call to the token: on the bundled MTP model, where a head call costs a third of a
    target step, the cost policy dropped most first tokens and ran at 0.85x plain while fixed k = 4 ran at 1.15x.
    """

    DROP = 0  # leave this token out, and stop drafting
    LAST = 1  # keep it, and stop
    MORE = 2  # keep it and draft the next


KeepGoing = Callable[[str, Sequence[float], float], Go]
"""(source, confidences of the tokens drafted so far, draft seconds spent) -> keep the last one, draft more?"""


@dataclass(frozen=True, slots=True)
class BatchLoad:
    """What the other generations already put in this step: their rows and expected committed tokens.

    With prompts waiting to be prefilled inside the step (a server's ``--batch-tokens``), draft rows and
    prompt chunks share one token budget: ``free_rows`` draft rows fit beside this step's prompt chunks
    (None: no prompt is waiting), and each draft row past them pushes one prompt token to a later step,
    priced at ``displaced_s``, the seconds a prompt token takes to prefill.  That price is not spent in
    this step; it is what a waiting request's first token is delayed by, so under a burst of prompts
    a draft row must be worth more than the prompt token it displaces and drafting shrinks.
    """

    rows: tuple[int, ...] = ()
    tokens: float = 0.0
    free_rows: int | None = None
    displaced_s: float = 0.0
    # Context depths, for rows that cost more the deeper their sequence (``CostModel.row_depth_s``): this
    # generation's, and the other generations' beside ``rows`` (None: at the cost curve's own depth).
    depth: int | None = None
    depths: tuple[int | None, ...] = ()

    def all_depths(self) -> tuple[int | None, ...]:
        """The others' depths, one per entry of ``rows``, then this generation's: what ``CostModel.batch_s`` takes
        beside ``rows + (n,)``."""
        return (*self.depths[: len(self.rows)], *(None,) * (len(self.rows) - len(self.depths)), self.depth)

    def displacement_s(self, draft_rows: int) -> float:
        """What ``draft_rows`` drafted rows cost in prompt tokens pushed to a later step."""
        if self.free_rows is None or draft_rows <= self.free_rows:
            return 0.0
        return (draft_rows - self.free_rows) * self.displaced_s


SOLO = BatchLoad()


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What a policy may learn from one verification step."""

    source: str
    n_drafted: int
    n_accepted: int
    draft_s: float
    verify_s: float
    other_s: float = 0.0  # the loop's own bookkeeping in this step (observe, commit, policy)
    # A plain step after the policy cut a draft to nothing: 1 if the draft's first token is the one the step
    # committed (it would have been accepted), 0 if not, -1 where no draft was declined.  A free outcome: a cost
    # policy that declines a source's drafts learns nothing from verifications, and would decline them for good.
    shadow: int = -1


class DraftLengthPolicy(Protocol):
    name: str
    book: "AcceptanceBook"  # acceptance by source, shared with cascade and fusion through Advice
    costs: CostModel | None  # the measured t(n) it prices with, if any (the engine refines it)

    def budget(self, cap: int, load: BatchLoad = SOLO, tree: bool = False) -> "Budget":
        """The next draft's budget, at most ``cap`` tokens (context, max_tokens and the loop's limit)."""

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from the step just verified."""

    def fork(self) -> "DraftLengthPolicy":
        """The policy one generation runs with (its own acceptance statistics, shared costs)."""

    def adopt(self, child: "DraftLengthPolicy") -> None:
        """Take a finished generation's statistics as the prior for later ones."""

    def expect_scores(self, sources: frozenset[str]) -> None:
        """These sources score their drafts (``drafters.base.scored_sources``), before any draft of theirs is seen."""

    def why_idle(self, stats: Any) -> str:
        """Why the generation of ``stats`` (``metrics.GenerationStats``) drafted nothing, in words."""


@dataclass(frozen=True)
class Advice:
    """The policy's statistics for drafters that choose between sources (cascade, fusion).

    ``learn`` scores a draft that was *not* verified against the committed
    tokens (greedy verification accepts exactly as far as they match), so a
    source that lost the choice keeps learning; the verified draft is learned
    by the policy itself from the step's outcome.
    """

    book: AcceptanceBook
    verify_cost: Callable[[int], float] = slope_cost

    def conditional(self, source: str, n: int) -> list[float]:
        return self.book.conditional(source, n)

    def learn(self, source: str, n_drafted: int, n_accepted: int) -> None:
        self.book.update(source, n_drafted, n_accepted)


@dataclass(frozen=True)
class Budget:
    """The policy's decision for one generation's next draft, passed to ``Drafter.propose``.

    max_tokens: a drafter never returns more tokens (tree nodes) than this.
    tree: a token tree may be returned; otherwise a chain.
    keep_going: for sources that draft token by token (a model), whether
      the token just drafted is worth verifying and one more worth drafting
      (``Go``); None means draft up to max_tokens.
    advice: acceptance by source and verification cost, for cascade/fusion.
    cut: how many of a source's n drafted tokens are worth verifying, given
      the draft's per-token scores if it has them (``Draft.scores``); the
      engine applies it once the draft is back.  None keeps all.
    expected: tokens the step is expected to commit for this generation
      (the engine tells the next generation's policy, for batch pricing).
    rows: rows this generation is expected to verify (1 + expected draft
      length; None: 1 + max_tokens), also for batch pricing.
    probe: the policy only wants to learn what this source's drafts are worth
      (drafting did not pay, or nothing is known yet): a drafter that must
      catch up on unseen context (a draft model) may draft from a short tail
      of it instead, so that a probe costs about what it can win back.
    skip: sources not to ask this step (a cascade passes over them, and the
      engine over a lone drafter so named): model sources whose own price
      says their call would not pay, beside a source that drafts this step.
    """

    max_tokens: int
    tree: bool = False
    keep_going: KeepGoing | None = None
    advice: Advice | None = None
    cut: Callable[[str, int, Sequence[float] | None], int] | None = None
    expected: float = 1.0
    rows: int | None = None
    probe: bool = False
    skip: frozenset[str] = frozenset()

    def worth(self, draft: "Draft") -> int:
        """Tokens of ``draft`` to verify: within the cap, and as the policy cut it."""
        n = min(len(draft), self.max_tokens)
        if self.cut is None or n == 0:
            return n
        scores = draft.scores()
        return min(n, self.cut(draft.source, n, None if scores is None else scores[:n]))

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise InvalidParameterError(f"a draft budget cannot be negative (got {self.max_tokens})")
