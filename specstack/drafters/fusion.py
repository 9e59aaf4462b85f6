"""Fusion: merge a retrieval tree and a draft-model chain into one tree, verified in one batch.

The RASD idea (retrieval-augmented speculative decoding): retrieved
continuations and model drafts are complementary, so verify both at once.
The source that has been winning goes in first: its tokens become the first
depth-first branch, the one tree verification keeps without re-decoding
the KV cache (a win by the other branch costs one extra chain batch).  The
other source's nodes follow, sharing any prefix the two agree on, until the
token budget is spent.  After each step the committed tokens tell which
source's draft matched further; a decayed tally of those wins decides the
order (the model's chain first until retrieval has won more).

Example, budget 5, model first: model chain ``[4, 7]``, retrieval tree
``4 -> 9``, ``2``: fused tree ``4 -> 7``, ``4 -> 9``, ``2`` (the shared
``4`` is one node).
With sampling, the model chain is returned alone with its q (rejection
sampling needs the proposal distribution of the tokens it verifies).
"""

from __future__ import annotations

from typing import Sequence

from ..errors import InvalidParameterError
from ..types import Draft
from .base import BuildContext, Drafter, create, register


class FusionDrafter:
    name = "fusion"

    def __init__(self, retrieval: Drafter, model: Drafter) -> None:
        if not hasattr(retrieval, "propose_tree"):
            raise InvalidParameterError(f"fusion needs a tree-capable retrieval source first (suffix or rest), not {retrieval.name!r}")
        self.retrieval, self.model = retrieval, model
        self.name = f"fusion:{retrieval.name},{model.name}"
        self.retrieval_lead = 0.0  # decayed (retrieval wins - model wins); > 0 puts retrieval first
        self._last: tuple[Draft, Draft] | None = None

    def bind_policy(self, policy: object) -> None:
        bind = getattr(self.model, "bind_policy", None)
        if bind is not None:
            bind(policy)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.retrieval.begin(prompt_ids)
        self.model.begin(prompt_ids)

    def propose(self, context_ids: Sequence[int], max_tokens: int) -> Draft:
        chain = self.model.propose(context_ids, max(1, max_tokens // 2))
        if chain.q is not None:
            return chain
        tree = self.retrieval.propose_tree(context_ids, max_tokens)
        self._last = (chain, tree)
        if self.retrieval_lead > 0:
            return fuse(tree, chain, max_tokens, self.name)
        return fuse(chain, tree, max_tokens, self.name)

    def observe(self, new_ids: Sequence[int], num_accepted: int) -> None:
        if self._last is not None:
            chain, tree = self._last
            model_run, retrieval_run = _matched(chain, new_ids), _matched(tree, new_ids)
            if model_run != retrieval_run:
                self.retrieval_lead = 0.9 * self.retrieval_lead + (1.0 if retrieval_run > model_run else -1.0)
            self._last = None
        self.retrieval.observe(new_ids, num_accepted)
        self.model.observe(new_ids, num_accepted)

    def end(self) -> None:
        self.retrieval.end()
        self.model.end()


def _parents(draft: Draft) -> tuple[int, ...]:
    """Parent indices of a tree draft; a chain's token i follows token i - 1."""
    return draft.parents if draft.parents is not None else tuple(range(-1, len(draft.token_ids) - 1))


def _matched(draft: Draft, committed: Sequence[int]) -> int:
    """How far the committed tokens follow some path of ``draft`` (a chain or a tree)."""
    parents = _parents(draft)
    node, depth = -1, 0
    for tok in committed:
        node = next((i for i, p in enumerate(parents) if p == node and draft.token_ids[i] == tok), None)
        if node is None:
            break
        depth += 1
    return depth


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


@register("fusion")
def _build(ctx: BuildContext) -> FusionDrafter:
    spec = (ctx.options.get("spec") or "suffix,draft-model").replace("+", ",")
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if len(names) != 2:
        raise InvalidParameterError("fusion takes two sources: fusion:RETRIEVAL,MODEL, e.g. fusion:suffix,draft-model")
    retrieval_ctx = BuildContext(ctx.target, {**ctx.options, "tree": True}, ctx.temperature)
    return FusionDrafter(create(names[0], retrieval_ctx), create(names[1], ctx))
