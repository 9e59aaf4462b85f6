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
    truth); a datastore sets ``n_matches`` (occurrences of the matched suffix)
    and ``n_sampled`` (how many of them were read).
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

    def draft(self, source: str, tree: bool) -> Draft:
        """The engine's draft: a tree keeps ``parents``, a chain drops them (they are 0..n-2 anyway)."""
        if not self.token_ids:
            return Draft.empty(source)
        return Draft(self.token_ids, source, parents=self.parents if tree else None, probs=self.probs)
