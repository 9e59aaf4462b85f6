"""Fusion: merge a retrieval tree and a draft-model chain into one tree, verified in one batch.

The RASD idea (retrieval-augmented speculative decoding): retrieved
continuations and model drafts are complementary, so verify both at once.
The source expected to match further goes in first: its tokens become the
first depth-first branch, the one tree verification keeps without
re-decoding the KV cache (a win by the other branch costs one extra chain
batch).  The other source's nodes follow, sharing any prefix the two agree
on, until the token budget is spent.  After each step the committed tokens
score both parts (greedy verification accepts a draft exactly as far as it
matches them) in the policy's acceptance statistics (``Budget.advice``),
which decide the order: the model's chain first on ties.

Example, budget 5, model first: model chain ``[4, 7]``, retrieval tree
``4 -> 9``, ``2``: fused tree ``4 -> 7``, ``4 -> 9``, ``2`` (the shared
``4`` is one node).
With sampling, the model chain is returned alone with its q (rejection
sampling needs the proposal distribution of the tokens it verifies).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from ..draft_length import DEFAULT_K_MAX, AcceptanceBook, Advice, Budget, expected_accepted
from ..errors import InvalidParameterError
from ..types import Draft, HiddenRows
from ..verify import matched_length
from .base import BuildContext, Drafter, DraftRequest, Sources, create, needs_hidden, register

NAME = "fusion"  # its registry name, for those that name it (default method lists, messages)


@dataclass
class _Step:
    chain: Draft
    tree: Draft
    advice: Advice


class FusionDrafter:
    name = NAME

    def __init__(self, retrieval: Drafter, model: Drafter) -> None:
        if retrieval.name not in ("suffix", "rest"):
            raise InvalidParameterError(f"fusion needs a tree-capable retrieval source first (suffix or rest), not {retrieval.name!r}")
        self.retrieval, self.model = retrieval, model
        self.name = f"fusion:{retrieval.name},{model.name}"
        self._own_book = AcceptanceBook(k_max=DEFAULT_K_MAX)  # only when a budget brings no advice
        self._steps: dict[int, _Step] = {}
        # A model that reads the target's hidden rows (mtp) gets them; its steps then verify chains (the fused tree's
        # leading branch), since rows of a tree's accepted path are not collected.
        self.needs_hidden = needs_hidden(model)

    def begin(self, prompt_ids: Sequence[int], seq: int = 0, hidden: HiddenRows | None = None) -> None:
        self._steps.pop(seq, None)
        self.retrieval.begin(prompt_ids, seq)
        if self.needs_hidden:
            self.model.begin(prompt_ids, seq, hidden=hidden)
        else:
            self.model.begin(prompt_ids, seq)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        half = [replace(r, budget=replace(r.budget, max_tokens=max(1, r.budget.max_tokens // 2))) for r in requests]
        chains = self.model.propose(half)
        whole = [DraftRequest(r.seq, r.context, Budget(r.budget.max_tokens, tree=True)) for r in requests]
        trees = self.retrieval.propose(whole)
        out = []
        for r, chain, tree in zip(requests, chains, trees):
            if chain.q is not None or r.budget.max_tokens <= 0:
                out.append(chain.truncated(r.budget.max_tokens))  # sampling: rejection needs the chain's q
                continue
            advice = r.budget.advice or Advice(self._own_book)
            self._steps[r.seq] = _Step(chain, tree, advice)
            k = r.budget.max_tokens
            lead = expected_accepted(advice.conditional(self.retrieval.name, k), k) - expected_accepted(
                advice.conditional(self.model.name, k), k)
            first, second = (tree, chain) if lead > 0 else (chain, tree)
            fused = fuse(first, second, k, self.name)
            out.append(fused if r.budget.tree else fused.best_chain())  # no tree allowed: the leading branch
        return out

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0, hidden: HiddenRows | None = None) -> None:
        step = self._steps.pop(seq, None)
        if step is not None:
            for part, source in ((step.chain, self.model.name), (step.tree, self.retrieval.name)):
                if part.token_ids:
                    m = matched_length(part.token_ids, new_ids, part.parents)
                    step.advice.learn(source, min(m + 1, len(new_ids), _depth(part)), m)
        self.retrieval.advance(new_ids, n_accepted, seq)
        if self.needs_hidden:
            self.model.advance(new_ids, n_accepted, seq, hidden=hidden)
        else:
            self.model.advance(new_ids, n_accepted, seq)

    def end(self, seq: int = 0, complete: bool = True) -> None:
        self._steps.pop(seq, None)
        self.retrieval.end(seq, complete)
        self.model.end(seq, complete)


def _depth(draft: Draft) -> int:
    """Longest root-to-leaf path of a chain or tree."""
    parents = _parents(draft)
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


def _parents(draft: Draft) -> tuple[int, ...]:
    """Parent indices of a tree draft; a chain's token i follows token i - 1."""
    return draft.parents if draft.parents is not None else tuple(range(-1, len(draft.token_ids) - 1))


def fuse(first: Draft, second: Draft, budget: int, source: str) -> Draft:
    """Insert ``first`` then ``second`` (chains or parents-first trees) into one tree of at most ``budget`` nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node

    def add(parent: int, token: int) -> int | None:
        node = children.get((parent, token))
        if node is not None:
            return node
        if len(tokens) >= budget:
            return None
        tokens.append(int(token))
        parents.append(parent)
        children[(parent, token)] = len(tokens) - 1
        return len(tokens) - 1

    for draft in (first, second):
        mapped: list[int | None] = []
        for tok, par in zip(draft.token_ids, _parents(draft)):
            parent = -1 if par < 0 else mapped[par]
            mapped.append(None if parent is None else add(parent, tok))
    if not tokens:
        return Draft.empty(source)
    return Draft(token_ids=tuple(tokens), source=source, parents=tuple(parents))


@register(NAME, Sources(min=2, max=2, first=("suffix", "rest"), example="fusion:suffix,draft-model"))
def _build(ctx: BuildContext) -> FusionDrafter:
    names = (ctx.options.get("spec") or "").split(",")  # RETRIEVAL,MODEL, checked by base.parse_name
    retrieval_ctx = BuildContext(ctx.target, {**ctx.options, "tree": True}, ctx.temperature)
    return FusionDrafter(create(names[0], retrieval_ctx), create(names[1], ctx))
