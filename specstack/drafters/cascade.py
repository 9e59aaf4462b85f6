"""Cascade: ask draft sources in order; later ones fill in where earlier ones come up short.

The research notes' combined stack (prompt lookup, then the suffix tree,
then the draft model), like llama.cpp's chained --spec-type list but with a
minimum length, per-source statistics (each sub-drafter names itself in
``Draft.source``) and a choice by expected value.

- **Asking.** Sources are asked in order until one offers at least
  ``min_len`` tokens (the research's "at least 3 tokens"), so later, costlier
  sources (a draft model) are only asked when earlier ones come up short,
  and never where the budget skips them (``Budget.skip``: the cost policy
  looks at a scored source every step, and a model source whose call would
  not pay waits for its probes).
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

from dataclasses import dataclass, field
from typing import Sequence

from ..draft_length import DEFAULT_K_MAX, AcceptanceBook, Advice, best_k, expected_accepted
from ..errors import InvalidParameterError
from ..types import Draft, HiddenRows
from ..verify import matched_length
from .base import (BuildContext, Drafter, DraftRequest, Sources, config_from_options, create, needs_hidden, register,
                   scored_sources)

NAME = "cascade"  # its registry name, for those that name it (default method lists, messages)


@dataclass(frozen=True)
class CascadeConfig:
    """sources: drafter names in priority order; min_len: tokens a draft needs to stop the cascade."""

    sources: tuple[str, ...]
    min_len: int = field(default=3, metadata={"option": "cascade_min_len"})  # --cascade-min-len

    def __post_init__(self) -> None:
        if len(self.sources) < 1:
            raise InvalidParameterError("cascade needs at least one source, e.g. cascade:prompt-lookup,suffix,draft-model")
        if any(s.startswith(NAME) for s in self.sources):
            raise InvalidParameterError("a cascade cannot contain another cascade")
        if len(set(self.sources)) != len(self.sources):
            raise InvalidParameterError(f"cascade lists a source twice: {','.join(self.sources)}")
        if self.min_len < 1:
            raise InvalidParameterError(f"cascade min_len must be >= 1 (got {self.min_len})")


@dataclass
class _Step:
    """One generation's drafts in the current step, and the advice they were chosen with."""

    drafts: list[tuple[int, Draft]]
    chosen: int | None
    advice: Advice
    learn_chosen: bool


class CascadeDrafter:
    name = NAME

    def __init__(self, drafters: Sequence[Drafter], config: CascadeConfig) -> None:
        self.drafters = list(drafters)
        self.config = config
        self.name = "cascade:" + ",".join(d.name for d in self.drafters)
        # Used only when a budget brings no advice (no policy): then it learns every draft itself.
        self._own_book = AcceptanceBook(k_max=DEFAULT_K_MAX)
        self._steps: dict[int, _Step] = {}
        # Which sources read hidden rows, asked once: a runtime protocol check costs ~30 us, and asked for each
        # source every step it was 5% of a 1.3 ms step on the bundled pair (`cascade:suffix,draft-model`).
        self._reads_hidden = [needs_hidden(d) for d in self.drafters]
        self.needs_hidden = any(self._reads_hidden)  # passed on to the sources that read them
        self.scored_sources = frozenset().union(*(scored_sources(d) for d in self.drafters))

    def begin(self, prompt_ids: Sequence[int], seq: int = 0, hidden: HiddenRows | None = None) -> None:
        self._steps.pop(seq, None)
        for d, reads in zip(self.drafters, self._reads_hidden):
            if reads:
                d.begin(prompt_ids, seq, hidden=hidden)
            else:
                d.begin(prompt_ids, seq)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        found: dict[int, list[tuple[int, Draft]]] = {r.seq: [] for r in requests}
        asking = [r for r in requests if r.budget.max_tokens > 0]
        for i, d in enumerate(self.drafters):
            if not asking:
                break
            short, skipped = [], [r for r in asking if d.name in r.budget.skip]  # the policy's: its call won't pay
            if skipped:
                asking = [r for r in asking if d.name not in r.budget.skip]
            for r, draft in zip(asking, d.propose(asking) if asking else ()):
                if draft.token_ids:
                    found[r.seq].append((i, draft))
                if len(draft) < min(self.config.min_len, r.budget.max_tokens):
                    short.append(r)
            asking = short + skipped
        return [self._choose(r, found[r.seq]) for r in requests]

    def _choose(self, request: DraftRequest, drafts: list[tuple[int, Draft]]) -> Draft:
        """The first source's draft stands unless a later one is worth more per unit of verification cost."""
        advice = request.budget.advice or Advice(self._own_book)
        step = self._steps[request.seq] = _Step(drafts, None, advice, request.budget.advice is None)
        if not drafts:
            return Draft.empty(self.name)
        if len(drafts) == 1 and drafts[0][0] == 0:
            step.chosen = 0
            return drafts[0][1]  # the first source's draft, nothing to weigh it against
        cost = advice.verify_cost
        best, best_value = Draft.empty(self.name), 1.0 / cost(1)  # a plain step
        for j, (i, draft) in enumerate(drafts):
            cond = advice.conditional(draft.source, len(draft))
            n = len(draft) if i == 0 else best_k(cond, _no_cost, cost, len(draft))
            if n == 0:
                continue  # no prefix of it beats a plain step
            value = (1.0 + expected_accepted(cond, n)) / cost(n + 1)
            if i == 0 or value > best_value:
                best, best_value, step.chosen = draft.truncated(n), value, j
        return best

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0, hidden: HiddenRows | None = None) -> None:
        step = self._steps.pop(seq, None)
        if step is not None:
            for j, (_, draft) in enumerate(step.drafts):
                if j != step.chosen or step.learn_chosen:  # the policy learns the verified one from the step
                    step.advice.learn(draft.source, *_outcome(draft.token_ids, new_ids))
        for d, reads in zip(self.drafters, self._reads_hidden):
            if reads:
                d.advance(new_ids, n_accepted, seq, hidden=hidden)
            else:
                d.advance(new_ids, n_accepted, seq)

    def end(self, seq: int = 0, complete: bool = True) -> None:
        self._steps.pop(seq, None)
        for d in self.drafters:
            d.end(seq, complete)


def _no_cost(k: int) -> float:
    """Retrieval drafts cost microseconds: only verification is priced."""
    return 0.0


def _outcome(draft: Sequence[int], committed: Sequence[int]) -> tuple[int, int]:
    """(positions known, positions accepted) for ``draft`` had it been verified greedily.

    The committed tokens are the target's own choices, so a draft is
    accepted exactly as far as it matches them; past their end the outcome
    is unknown, so those positions are left out.
    """
    m = matched_length(draft, committed)
    if m < min(len(draft), len(committed)):
        return m + 1, m  # rejected at position m
    return m, m  # all matched (or matched until the committed tokens ran out)


@register(NAME, Sources(min=1, example="cascade:suffix,prompt-lookup,draft-model"))
def _build(ctx: BuildContext) -> CascadeDrafter:
    sources = tuple((ctx.options.get("spec") or "").split(","))  # checked by base.parse_name
    config = config_from_options(CascadeConfig, ctx.options, sources=sources)
    return CascadeDrafter([create(name, ctx) for name in config.sources], config)
