"""Drafting from a suffix tree: a greedy chain (``propose``) or a best-first tree (``propose_tree``).

Both search every match length m the same way (``_best_draft``: caps that
shrink with m, the best score wins, the longer match on ties); only the growth
from one match state differs.  The chain is scored label by label and its
tokens are read only if it wins, which keeps trying every m cheap; the tree's
score needs the whole tree, so it is built at once.  They are kept apart
because the chain's score (``p * run`` per label) is the reference's, which a
per-token sum would change in the last bits.
"""

from __future__ import annotations

import heapq
from array import array
from dataclasses import replace
from typing import Callable, Mapping, Sequence

from .lookup import Lookup
from .suffix_node import Node, State
from .suffix_tree import SuffixTree

__all__ = ["propose", "propose_tree"]


Texts = Mapping[int, array]  # the tree's token arrays, which node labels point into
_Grown = tuple[float, Callable[[], Lookup]]  # a draft's score now, the draft itself on demand
_Grow = Callable[[Texts, Node, int, int, float, int, int], _Grown]  # (texts, node, idx, cap, min_prob, m, open_end)


def propose(
    tree: SuffixTree,
    context: Sequence[int] | list[State],
    max_tokens: int,
    max_spec_factor: float = 1.0,
    max_spec_offset: float = 0.0,
    min_token_prob: float = 0.1,
    open_end: bool = False,
) -> Lookup:
    """Best greedy path over every match length m (ArcticInference calls this ``speculate``).

    For each m the draft follows the most frequent child, at most
    ``min(max_tokens, floor(max_spec_factor * m + max_spec_offset))`` tokens,
    stopping when the path probability drops below ``min_token_prob``;
    the highest score wins, the longer match on ties.  ``context`` is a token
    list or precomputed states (``match_states``/``active_states``/a matcher).

    ``open_end``: the context is the end of a sequence the tree holds and is still extending (a request's
    own tree, ``active_states``).  That occurrence is counted at every match state but has no continuation
    yet, so it is left out of the first branch's denominator: it is not evidence against what followed the
    earlier occurrences.  Counted, one earlier occurrence of a copied line scored 1/2 where it is 1, and the
    cost policy declined a verbatim copy for a dozen steps (Gemma 3 270M, a grounded edit).
    """
    return _best_draft(tree, _path, context, max_tokens, max_spec_factor, max_spec_offset, min_token_prob, open_end)


def propose_tree(
    tree: SuffixTree,
    context: Sequence[int] | list[State],
    max_tokens: int,
    max_spec_factor: float = 1.0,
    max_spec_offset: float = 0.0,
    min_token_prob: float = 0.1,
    open_end: bool = False,
) -> Lookup:
    """Like ``propose`` but each m grows a best-first tree of up to the cap in tokens.

    Nodes are taken in order of path probability (a priority queue), so the
    tree holds the most likely continuations within the token budget.
    """
    return _best_draft(tree, _best_first, context, max_tokens, max_spec_factor, max_spec_offset, min_token_prob,
                       open_end)


def _best_draft(tree: SuffixTree, grow: _Grow, context: Sequence[int] | list[State], max_tokens: int,
                factor: float, offset: float, min_prob: float, open_end: bool = False) -> Lookup:
    """The best-scoring of ``grow``'s drafts over every match length m, the longest match on ties.

    Caps shrink with m and a draft never scores above its cap, so the search
    stops at the first m whose cap cannot beat the best score so far.
    """
    states = _states(tree, context)
    texts = tree.texts
    best_score, best, seen = 0.0, Lookup, 0
    for m in range(len(states), 0, -1):
        cap = _cap(m, max_tokens, factor, offset)
        if cap <= best_score:
            break
        node, idx = states[m - 1]
        score, draft = grow(texts, node, idx, cap, min_prob, m, int(open_end))
        if score > best_score:
            best_score, best, seen = score, draft, node.count - int(open_end)
    found = best()
    return replace(found, n_matches=seen) if found.token_ids else found


def _states(tree: SuffixTree, context: Sequence[int] | list[State]) -> list[State]:
    """Match states as given, or matched now from a token list."""
    if context and isinstance(context[0], tuple):
        return context  # type: ignore[return-value]
    return tree.match_states(context)  # type: ignore[arg-type]


def _cap(m: int, max_tokens: int, factor: float, offset: float) -> int:
    """Most tokens a match of m tokens may draft (the 1e-6 absorbs float error in factor * m)."""
    return max(0, min(max_tokens, int(m * factor + offset + 1e-6)))


def _path(texts: Texts, node: Node, idx: int, cap: int, min_prob: float, m: int, open_end: int = 0) -> _Grown:
    """The greedy path from a match state: the most frequent child at every node.

    It is scored as it is walked, one step per node; its tokens are read
    only if it wins (``_chain``), which keeps trying every m cheap.  ``open_end``
    occurrences end at the match state and leave the first branch's count (``propose``).
    """
    segments: list[tuple[Node, int, int, float]] = []  # (node, label offset, tokens taken, path probability)
    n, p, score = 0, 1.0, 0.0
    while True:
        rest = node.length - idx
        if rest > 0:
            take = rest if rest < cap - n else cap - n
            segments.append((node, idx, take, p))
            n += take
            score += p * take
            if n >= cap:
                break
        b = node.best
        if b is None:
            break
        p = p * b.count / max(node.count - open_end, b.count)
        if p < min_prob:
            break
        node, idx, open_end = b, 0, 0
    return score, lambda: _chain(texts, segments, score, m)


def _chain(texts: Texts, segments: list[tuple[Node, int, int, float]], score: float, m: int) -> Lookup:
    """The chain draft ``_path`` scored: its segments' tokens, each with its path probability."""
    toks: list[int] = []
    probs: list[float] = []
    for node, idx, take, p in segments:
        s = node.start + idx
        toks.extend(texts[node.seq][s : s + take])
        probs.extend([p] * take)
    return Lookup(tuple(toks), tuple(range(-1, len(toks) - 1)), tuple(probs), match_len=m, score=score)


def _best_first(texts: Texts, node: Node, idx: int, cap: int, min_prob: float, m: int, open_end: int = 0) -> _Grown:
    """The best-first tree from a match state (its score needs the whole tree, so it is built now); ``open_end``
    as ``_path`` takes it, at the match state's node only."""
    start = node
    toks: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    tie = 0  # heap tie-breaker: first pushed first
    heap: list[tuple[float, int, Node, int, int]] = [(-1.0, tie, node, idx, -1)]
    while heap and len(toks) < cap:
        neg_p, _, node, idx, parent = heapq.heappop(heap)
        if idx < node.length:
            toks.append(texts[node.seq][node.start + idx])
            parents.append(parent)
            probs.append(-neg_p)
            tie += 1
            heapq.heappush(heap, (neg_p, tie, node, idx + 1, len(toks) - 1))
        elif node.children:
            seen = node.count - open_end if node is start else node.count
            for ch in node.children.values():
                p = -neg_p * ch.count / max(seen, ch.count)
                if p >= min_prob:
                    tie += 1
                    heapq.heappush(heap, (-p, tie, ch, 0, parent))
    draft = Lookup(tuple(toks), tuple(parents), tuple(probs), match_len=m, score=sum(probs))
    return draft.score, lambda: draft
