"""Value types shared by the engine, drafters, verifier and reports.

Names follow the papers: ``p`` is the target's distribution, ``q`` the draft's.
Outcomes are *accepted* (a draft token kept), *recovered* (resampled after a
rejection) and *bonus* (the extra target token when every draft token is kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Draft:
    """What a drafter proposes for one verification step.

    ``q`` is ``None`` for deterministic sources (n-gram lookup, greedy model
    drafts): the verifier then treats each token as a point mass.  When set it
    holds the distribution each token was *actually sampled from*, shape
    ``[len(token_ids), n_vocab]``; rejection sampling is only lossless if so.

    ``probs`` (retrieval drafters: suffix, rest) is the drafter's estimate, per
    token, that the path from the root through that token is accepted: the
    fraction of matched occurrences that continue with it.  It is a report,
    not a distribution: the verifier never reads it.
    """

    token_ids: tuple[int, ...]
    source: str
    q: np.ndarray | None = None
    parents: tuple[int, ...] | None = None  # tree drafts: parent index per token, -1 = root
    probs: tuple[float, ...] | None = None  # estimated path acceptance per token (retrieval drafts)
    origins: tuple[str, ...] | None = None  # chains mixing sources (the grammar's forced tokens): each token's source

    def origin(self, i: int) -> str:
        """The source of token ``i``."""
        return self.source if self.origins is None else self.origins[i]

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncated(self, n: int) -> "Draft":
        """The first n tokens (and their q rows, probs); trees are cut to their first n nodes."""
        if n >= len(self.token_ids):
            return self
        return Draft(
            token_ids=self.token_ids[:n],
            source=self.source,
            q=None if self.q is None else self.q[:n],
            parents=None if self.parents is None else self.parents[:n],
            probs=None if self.probs is None else self.probs[:n],
            origins=None if self.origins is None else self.origins[:n],
        )

    def scores(self) -> tuple[float, ...] | None:
        """Per-token acceptance estimates of a chain with ``probs``: each token's probability given its
        predecessors (a path probability over its parent's), or None (no probs, or a tree).

        The cost policy prices a retrieval draft by these, so that a continuation seen many times is
        verified whole while a branch point stops it.
        """
        if self.probs is None or self.is_tree or not self.probs:
            return None
        out, before = [], 1.0
        for p in self.probs:
            out.append(min(1.0, p / before) if before > 0 else 0.0)
            before = p
        return tuple(out)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None and any(p != i - 1 for i, p in enumerate(self.parents))

    def best_chain(self) -> "Draft":
        """The first root-to-leaf path of a tree (drafters list the best child first)."""
        if not self.is_tree:
            return Draft(self.token_ids, self.source, self.q, probs=self.probs, origins=self.origins)
        path, node = [], -1
        while True:
            nxt = next((i for i, p in enumerate(self.parents) if p == node), None)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        return Draft(tuple(self.token_ids[i] for i in path), self.source, probs=self._probs_at(path))

    def depth_first(self) -> "Draft":
        """The same tree with nodes renumbered depth-first, children in their listed order.

        Drafters list the best child first, so the first branch becomes nodes
        0, 1, 2, ...: the layout tree verification can keep without re-decoding.
        """
        if not self.is_tree:
            return self
        children: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            children.setdefault(p, []).append(i)
        order: list[int] = []
        stack = list(reversed(children.get(-1, [])))
        while stack:
            i = stack.pop()
            order.append(i)
            stack.extend(reversed(children.get(i, [])))
        new_index = {old: new for new, old in enumerate(order)}
        return Draft(
            token_ids=tuple(self.token_ids[i] for i in order),
            source=self.source,
            parents=tuple(-1 if self.parents[i] < 0 else new_index[self.parents[i]] for i in order),
            probs=self._probs_at(order),
        )

    def _probs_at(self, indices: list[int]) -> tuple[float, ...] | None:
        return None if self.probs is None else tuple(self.probs[i] for i in indices)

    def branches(self) -> int:
        """Number of root-to-leaf paths (llama.cpp sequences needed to verify it)."""
        if not self.is_tree:
            return 1
        has_child = set(self.parents)
        return sum(1 for i in range(len(self.token_ids)) if i not in has_child)

    @staticmethod
    def empty(source: str) -> "Draft":
        return Draft(token_ids=(), source=source)


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Outcome of verifying one draft: the tokens to commit, in order.

    ``token_ids`` is the accepted draft prefix followed by exactly one target
    token (recovered on a rejection, bonus when all were accepted), so
    ``len(token_ids) == n_accepted + 1`` always.
    """

    token_ids: tuple[int, ...]
    n_accepted: int


@dataclass(frozen=True, slots=True)
class HiddenRows:
    """The target's hidden rows for consecutive positions of one sequence: the channel from the engine to
    drafters that condition on the target (``Drafter.needs_hidden``: MTP heads, EAGLE-3 heads).

    Row i is the hidden state the target computed at position ``start + i``, the one its head read to
    predict the token after it (for MTP, llama.cpp's ``t_h_nextn``: the post-final-norm row; for a trained head,
    EAGLE-3 or DFlash, the inputs of the target layers it names, side by side: ``[L_a | L_b | L_c]``). Only rows of
    tokens the target kept reach a drafter: a verification's rows stop at its last accepted token, whose
    row predicted the step's own target token (llama.cpp's carry-over ``pending_h``).
    """

    start: int
    rows: np.ndarray  # [n, n_embd] float32 (a head's layer inputs: [n, n_layers * n_embd])

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @property
    def end(self) -> int:
        """The position after the last row."""
        return self.start + len(self)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The target's log-probability of one committed token, and of its ``top`` alternatives (id, logprob),
    most likely first.  Read from the row that verified the token, so a draft token accepted from a
    verification batch gets the same number plain decoding computes for it (where the call shapes are exact)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


__all__ = ["Draft", "HiddenRows", "TokenLogprob", "VerifyResult"]
