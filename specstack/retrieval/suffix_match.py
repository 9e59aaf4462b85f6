"""Streaming a context's match states in a suffix tree (``SuffixMatcher``).

A drafter matches a context against a tree it did not build from that context
(the global tree of earlier requests), so the tree's own active nodes do not
help; matching from scratch (``SuffixTree.match_states``) costs O(max_depth^2)
per step.  The matcher instead moves its states on by each committed token.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .suffix_node import State
from .suffix_tree import SuffixTree

__all__ = ["SuffixMatcher"]


class SuffixMatcher:
    """Streams a context and keeps its match states in a tree that changes rarely.

    Each pushed token advances every state by one token (O(M)), so a drafter
    matching against a global tree pays O(max_depth) per token instead of
    O(max_depth^2) per proposal.  If the tree changes, states are recomputed
    from the last ``max_depth`` tokens.
    """

    def __init__(self, tree: SuffixTree, context: Sequence[int] = ()) -> None:
        self.tree = tree
        self._recent: list[int] = []
        self._states: list[State] = []
        self._version = -1
        self.reset(context)

    def reset(self, context: Sequence[int]) -> None:
        self._recent = [int(t) for t in context[-self.tree.max_depth :]]
        self._resync()

    def extend(self, token_ids: Iterable[int]) -> None:
        depth = self.tree.max_depth
        for t in token_ids:
            t = int(t)
            self._recent.append(t)
            if self._version == self.tree.version:
                self._states = self._advance(self._states, t)
        if len(self._recent) > 2 * depth:
            del self._recent[:-depth]

    def states(self) -> list[State]:
        """``states[m-1]`` is where the context's last m tokens end, as ``SuffixTree.match_states`` gives."""
        if self._version != self.tree.version:
            self._resync()
        return self._states

    def _resync(self) -> None:
        states: list[State] = []
        for t in self._recent[-self.tree.max_depth :]:
            states = self._advance(states, t)
        self._states = states
        self._version = self.tree.version

    def _advance(self, states: list[State], t: int) -> list[State]:
        seqs = self.tree.texts
        out: list[State] = []
        for node, idx in [(self.tree.root, 0), *states]:
            if idx < node.length:
                if seqs[node.seq][node.start + idx] != t:
                    break
                out.append((node, idx + 1))
            else:
                ch = node.children.get(t) if node.children else None
                if ch is None:
                    break  # longer suffixes cannot match either
                out.append((ch, 1))
        return out  # no node is deeper than max_depth, so neither is any state
