"""Cascade: ask draft sources in order; later ones fill in where earlier ones come up short.

The research notes' combined stack (prompt lookup, then the suffix tree,
then the draft model), like llama.cpp's chained --spec-type list but with a
minimum length, per-source statistics (each sub-drafter names itself in
``Draft.source``) and a choice by expected value.

- **Asking.** Sources are asked in order until one offers at least
  ``min_len`` tokens (the research's "at least 3 tokens"), so later, costlier
  sources (a draft model) are only asked when earlier ones come up short.
- **Choosing.** The first source's draft (or, if it has none, a plain step)
  stands unless a later source's draft is worth more: each is valued at the
  tokens it is expected to commit per unit of verification cost, from its
  source's measured acceptance by position, and a later draft is cut to its
  most valuable length.  So a cascade drafts at least as well as its first
  source alone, and a fallback that is mostly wrong in the steps where it is
  asked (prompt lookup after the suffix tree: 10% of its tokens accepted on
  grounded code here) stops costing verification time.
- **Learning.** Every source learns from every step it drafted in, won or
  not: greedy verification accepts a draft exactly as far as it matches the
  committed tokens, so each draft is scored against them.

Example: ``cascade:suffix,prompt-lookup`` (or ``suffix+prompt-lookup``
inside a comma-separated list).  A 4-token suffix draft is used as is.  A
1-token suffix draft sends the cascade on to prompt lookup, whose draft
replaces it only if prompt lookup's record says it is worth more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..draft_length import AcceptanceTracker, best_k, expected_accepted
from ..errors import InvalidParameterError
from ..types import Draft
from .base import BuildContext, Drafter, create, register

# Relative verification cost t(n)/t(2) = 1 + VERIFY_SLOPE * (n - 2) when the
# policy has no measured curve (a plain step is padded to 2 tokens, so a
# 1-token draft is free): the slope was 0.2 on pycoder-6m and 0.1 on a 1B
# model with 2 cores here (t(17) = 1.28 vs t(2) = 0.32 ms; 142 vs 67 ms).
VERIFY_SLOPE = 0.15


@dataclass(frozen=True)
class CascadeConfig:
    """sources: drafter names in priority order; min_len: tokens a draft needs to stop the cascade."""

    sources: tuple[str, ...]
    min_len: int = 3

    def __post_init__(self) -> None:
        if len(self.sources) < 1:
            raise InvalidParameterError("cascade needs at least one source, e.g. cascade:prompt-lookup,suffix,draft-model")
        if any(s.startswith("cascade") for s in self.sources):
            raise InvalidParameterError("a cascade cannot contain another cascade")
        if len(set(self.sources)) != len(self.sources):
            raise InvalidParameterError(f"cascade lists a source twice: {','.join(self.sources)}")
        if self.min_len < 1:
            raise InvalidParameterError(f"cascade min_len must be >= 1 (got {self.min_len})")


class CascadeDrafter:
    name = "cascade"

    def __init__(self, drafters: Sequence[Drafter], config: CascadeConfig) -> None:
        self.drafters = list(drafters)
        self.config = config
        self.name = "cascade:" + ",".join(d.name for d in self.drafters)
        self.trackers = [AcceptanceTracker(k_max=16) for _ in self.drafters]
        self._verify_cost: Callable[[int], float] = lambda n: 1.0 + VERIFY_SLOPE * max(0, n - 2)
        self._drafts: list[tuple[int, Draft]] = []  # this step's drafts by source index

    def bind_policy(self, policy: object) -> None:
        """Pass the policy on; a policy with a measured cost curve also prices this cascade's choice."""
        costs = getattr(policy, "costs", None)
        if costs is not None and hasattr(costs, "verify_s"):
            self._verify_cost = costs.verify_s
        for d in self.drafters:
            bind = getattr(d, "bind_policy", None)
            if bind is not None:
                bind(policy)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self._drafts = []
        for d in self.drafters:
            d.begin(prompt_ids)

    def propose(self, context_ids: Sequence[int], max_tokens: int) -> Draft:
        need = min(self.config.min_len, max_tokens)
        self._drafts = []
        for i, d in enumerate(self.drafters):
            draft = d.propose(context_ids, max_tokens)
            if draft.token_ids:
                self._drafts.append((i, draft))
                if len(draft) >= need:
                    break
        if not self._drafts:
            return Draft.empty(self.name)
        if len(self._drafts) == 1 and self._drafts[0][0] == 0:
            return self._drafts[0][1]  # the first source's draft, nothing to weigh it against
        # The first source's draft stands unless a later one is worth more, so a
        # cascade drafts at least as well as its first source alone would.
        best, best_value = Draft.empty(self.name), 1.0 / self._verify_cost(1)  # a plain step
        for i, draft in self._drafts:
            cond = self._conditional(i, len(draft))
            n = len(draft) if i == 0 else best_k(cond, _no_cost, self._verify_cost, len(draft))
            if n == 0:
                continue  # no prefix of it beats a plain step
            value = (1.0 + expected_accepted(cond, n)) / self._verify_cost(n + 1)
            if i == 0 or value > best_value:
                best, best_value = draft.truncated(n), value
        return best

    def _conditional(self, source: int, n: int) -> list[float]:
        """The source's acceptance at positions 1..n; deep positions keep the last tracked rate."""
        cond = self.trackers[source].conditional()
        return cond + [cond[-1]] * (n - len(cond)) if n > len(cond) else cond

    def observe(self, new_ids: Sequence[int], num_accepted: int) -> None:
        for i, draft in self._drafts:
            drafted, accepted = _outcome(draft.token_ids, new_ids)
            self.trackers[i].update(drafted, accepted)
        self._drafts = []
        for d in self.drafters:
            d.observe(new_ids, num_accepted)

    def end(self) -> None:
        self._drafts = []
        for d in self.drafters:
            d.end()


def _no_cost(k: int) -> float:
    """Retrieval drafts cost microseconds: only verification is priced."""
    return 0.0


def _outcome(draft: Sequence[int], committed: Sequence[int]) -> tuple[int, int]:
    """(positions known, positions accepted) for ``draft`` had it been verified greedily.

    The committed tokens are the target's own choices, so a draft is
    accepted exactly as far as it matches them; past their end the outcome
    is unknown, so those positions are left out.
    """
    m = 0
    for a, b in zip(draft, committed):
        if a != b:
            return m + 1, m  # rejected at position m
        m += 1
    return m, m  # all matched (or matched until the committed tokens ran out)


@register("cascade")
def _build(ctx: BuildContext) -> CascadeDrafter:
    spec = (ctx.options.get("spec") or "").replace("+", ",")  # '+' also separates (for comma lists)
    sources = tuple(s.strip() for s in spec.split(",") if s.strip())
    config = CascadeConfig(sources=sources, min_len=int(ctx.options.get("cascade_min_len") or 3))
    return CascadeDrafter([create(name, ctx) for name in config.sources], config)
