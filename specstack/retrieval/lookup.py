"""What a retrieval structure finds for one context: the one result type of ``suffix_tree`` and ``datastore``.

A drafter ranks lookups by their statistics and hands the engine a
``types.Draft`` (``Lookup.draft``), the one draft value that crosses module
boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..types import Draft


@dataclass(frozen=True, slots=True)
class Lookup:
    """Draft tokens found for one context: a chain, or a tree when ``parents`` branch.

    ``parents[i]`` is the index of token i's parent in ``token_ids`` (-1: it
    follows the context directly); ``probs[i]`` is token i's path probability
    in the structure's counts.  ``match_len`` is the length of the context
    suffix that was matched.  A suffix tree sets ``score`` (``sum(probs)`` for
    a tree, the expected number of accepted tokens if the counts were the
    truth) and ``n_matches`` (earlier occurrences of the matched suffix); a
    datastore sets ``n_matches`` (occurrences of the matched suffix) and
    ``n_sampled`` (how many of them were read).
    """

    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    match_len: int = 0
    score: float = 0.0
    n_matches: int = 0
    n_sampled: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def draft(self, source: str, tree: bool, evidence: bool = False) -> Draft:
        """The engine's draft: a tree keeps ``parents``, a chain drops them (they are 0..n-2 anyway).

        ``evidence``: weigh each token's path probability by how much the match says (``going_on`` per token of
        depth, from ``match_len`` and ``n_matches``), the estimate the cost policy reads.  Counts alone give a
        continuation seen once after a 2-token match and one seen once after a 40-token match the same 1.0; the
        first is a coincidence, the second a copy.
        """
        if not self.token_ids:
            return Draft.empty(source)
        probs = self.probs
        if evidence and probs:
            go = going_on(self.match_len, max(self.n_matches, 1))
            depth: list[int] = []
            for parent in self.parents:
                depth.append(1 if parent < 0 else depth[parent] + 1)
            probs = tuple(p * go ** d for p, d in zip(probs, depth))
        return Draft(self.token_ids, source, parents=self.parents if tree else None, probs=probs)


def going_on(match_len: int, seen: int = 1) -> float:
    """P(a copied continuation goes on one more token) after a match of ``match_len`` tokens seen ``seen`` times
    before: Laplace's rule of succession over that evidence, 1 - 1 / (match_len + seen + 1).  A line copied from
    the prompt (one earlier occurrence, a 40-token match) goes on at 0.98 a token, a one-token coincidence at 0.67."""
    return 1.0 - 1.0 / (match_len + seen + 1)
