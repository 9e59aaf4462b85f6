"""A node of the suffix tree, and its reference into the token arrays.

A node does not copy its label: it points at ``(sequence, start, length)``
in one of the tree's token arrays.  This module holds that record and the
rules that depend only on nodes and arrays (which child is the best, how to
re-point a reference whose sequence is being removed), so ``suffix_tree``
(which changes the tree) and its readers (``suffix_match``, ``suffix_draft``)
share one definition without depending on each other.
"""

from __future__ import annotations

from array import array
from typing import Mapping

__all__ = ["Node", "State", "best_child", "repoint"]


class Node:
    """A tree node: its label is ``seqs[seq][start:start + length]``.

    Invariants: every token of a label has the same count (so every suffix
    ends exactly at a node end); ``count >= sum(child.count)`` and the
    difference is the number of suffixes ending here; a non-root node never has
    a single child with the same count (it would be merged: compression);
    ``seqs[seq]`` holds the node's whole root path, ending at
    ``start + length``; ``best`` is the child with the largest count, the
    smallest first token on ties (a rule, not an accident of history, so a
    rebuilt tree drafts exactly like the original).
    """

    __slots__ = ("count", "children", "parent", "seq", "start", "length", "best")

    def __init__(self, count: int, parent: "Node | None", seq: int, start: int, length: int) -> None:
        self.count = count
        self.children: dict[int, Node] | None = None  # None for leaves: saves a dict per leaf
        self.parent = parent
        self.seq = seq
        self.start = start
        self.length = length
        self.best: Node | None = None


State = tuple[Node, int]  # (node, tokens of its label matched so far, 1..length; 0 only at the root)


def best_child(children: dict[int, Node]) -> Node:
    """The child ``Node.best`` must be: the largest count, the smallest token on ties."""
    key = max(children, key=lambda t: (children[t].count, -t))
    return children[key]


def repoint(node: Node, dead: int, dead_seq: array, seqs: Mapping[int, array]) -> None:
    """Give ``node`` (and stale nodes down to a live reference) a reference outside sequence ``dead``.

    Only out-of-order removal needs this: with FIFO removal no surviving node
    points into the removed sequence.  ``seqs`` may still hold ``dead``.
    """
    # Any node below with a live reference holds our whole path too.
    queue, found = [node], None
    while queue and found is None:
        nxt = []
        for x in queue:
            if x.seq != dead:
                found = x
                break
            if x.children:
                nxt.extend(x.children.values())
        queue = nxt
    if found is not None:
        # Walk up from `found` to `node`, fixing stale references on the way.
        d = _depth(found)
        path_start = found.start + found.length - d
        x = found
        while x is not node:
            d -= x.length
            x = x.parent  # type: ignore[assignment]
            if x.seq == dead:
                x.seq = found.seq
                x.start = path_start + d - x.length
        return
    # Last resort: find the path in a remaining sequence.
    d = _depth(node)
    end = node.start + node.length
    path = dead_seq[end - d : end]
    for sid, s in seqs.items():
        if sid == dead:
            continue
        at = _find(s, path)
        if at >= 0:
            node.seq = sid
            node.start = at + d - node.length
            return
    raise AssertionError("suffix tree: live node with no occurrence left")  # pragma: no cover


def _depth(node: Node) -> int:
    """Tokens on the root path down to the end of ``node``."""
    d = 0
    while node is not None:
        d += node.length
        node = node.parent  # type: ignore[assignment]
    return d


def _find(seq: array, pattern: array) -> int:
    """First index where ``pattern`` occurs in ``seq``, or -1 (plain scan)."""
    n, first = len(pattern), pattern[0]
    i = -1
    try:
        while True:
            i = seq.index(first, i + 1)
            if seq[i : i + n] == pattern:
                return i
    except ValueError:
        return -1
