"""Verification of a draft against the target: greedy matching and rejection sampling.

Notation (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with
Speculative Sampling"): ``p`` is the target distribution, ``q`` the draft
distribution.  Draft token x_i is *accepted* with probability
min(1, p_i(x_i) / q_i(x_i)).  At the first rejection a *recovered* token is
drawn from normalize(max(0, p_i - q_i)); if every token is accepted, a *bonus*
token is drawn from p_k.  The committed sequence is then distributed exactly
as k+1 tokens of plain sampling from p.

These are pure functions of arrays and an rng, so losslessness can be tested
without a model.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .sampling import sample, sample_at
from .types import VerifyResult


def matched_length(draft_ids: Sequence[int], truth: Sequence[int], parents: Sequence[int] | None = None) -> int:
    """How many tokens of ``truth`` the draft predicts from its start: what greedy verification accepts.

    The one definition of "longest matching prefix", for verification, replay and the drafters that
    score their drafts against committed tokens.  A chain (``parents`` None) matches its longest
    common prefix with ``truth``; a tree (``parents[i]`` is node i's parent, -1 the root) matches
    along the path ``truth`` takes through it.

    >>> matched_length([5, 6, 7], [5, 6, 9])
    2
    >>> matched_length([5, 6, 7], [6, 7, 1], parents=[-1, -1, 1])
    2
    """
    if parents is None:
        n = 0
        for d, t in zip(draft_ids, truth):
            if d != t:
                break
            n += 1
        return n
    children: dict[tuple[int, int], int] = {}
    for i, (tok, par) in enumerate(zip(draft_ids, parents)):
        children.setdefault((int(par), int(tok)), i)  # a duplicate sibling never wins: the first does
    node, n = -1, 0
    for t in truth:
        node = children.get((node, int(t)))
        if node is None:
            break
        n += 1
    return n


def verify_greedy(draft_ids: Sequence[int], target_argmax: Sequence[int]) -> VerifyResult:
    """Accept the longest draft prefix equal to the target's argmax, then add its next token.

    ``target_argmax[i]`` is the target's choice after the context plus
    ``draft_ids[:i]``; it has ``len(draft_ids) + 1`` entries.

    >>> verify_greedy([5, 6, 7], [5, 6, 9, 1]).token_ids
    (5, 6, 9)
    """
    n = matched_length(draft_ids, target_argmax)
    return VerifyResult(token_ids=tuple(int(x) for x in draft_ids[:n]) + (int(target_argmax[n]),), n_accepted=n)


def verify_sampling(
    draft_ids: Sequence[int],
    q: np.ndarray | None,
    p: np.ndarray,
    rng: np.random.Generator,
    uniforms: Sequence[float] | None = None,
) -> VerifyResult:
    """Rejection-sample a draft against the target distributions.

    p: [k+1, V] target probabilities (row i conditions on draft_ids[:i]).
    q: [k, V] draft probabilities, or None for a deterministic draft (each
       token is a point mass, so acceptance is p(x) and the residual is p
       with x removed).
    uniforms: with a deterministic draft, the k+1 positions' own uniforms
       (``sampling.PositionUniforms``): the target's token at each position is
       drawn at its uniform and the draft token is accepted when it is that
       token. Acceptance is p(x) and a rejection yields the residual, exactly as
       below, and the tokens are those plain decoding draws with the same uniforms.
    """
    k = len(draft_ids)
    if p.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} target rows for a draft of {k} tokens, got {p.shape[0]}")
    if q is not None and q.shape[0] < k:
        raise ValueError(f"need {k} draft rows, got {q.shape[0]}")
    if q is None and uniforms is not None:
        return _verify_coupled(draft_ids, p, uniforms)
    accepted: list[int] = []
    for i, x in enumerate(draft_ids):
        x = int(x)
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        if _accept(px, qx, rng):
            accepted.append(x)
            continue
        recovered = sample(_residual(p[i], None if q is None else q[i], x), rng)
        return VerifyResult(token_ids=tuple(accepted) + (recovered,), n_accepted=i)
    bonus = sample(p[k], rng)
    return VerifyResult(token_ids=tuple(accepted) + (bonus,), n_accepted=k)


def _verify_coupled(draft_ids: Sequence[int], p: np.ndarray, uniforms: Sequence[float]) -> VerifyResult:
    """A deterministic draft against the tokens the target draws at each position's own uniform."""
    k = len(draft_ids)
    if len(uniforms) != k + 1:
        raise ValueError(f"need {k + 1} uniforms for a draft of {k} tokens, got {len(uniforms)}")
    for i, x in enumerate(draft_ids):
        y = sample_at(p[i], uniforms[i])
        if y != int(x):
            return VerifyResult(token_ids=tuple(int(t) for t in draft_ids[:i]) + (y,), n_accepted=i)
    return VerifyResult(token_ids=tuple(int(t) for t in draft_ids) + (sample_at(p[k], uniforms[k]),), n_accepted=k)


def _accept(px: float, qx: float, rng: np.random.Generator) -> bool:
    """Accept with probability min(1, px/qx).

    qx == 0 means the draft proposed a token it gave no mass (only possible
    with a buggy or foreign drafter); it is accepted iff the target allows it,
    which is the limit of the ratio and keeps the output inside p's support.
    """
    if px <= 0.0:
        return False
    if qx <= 0.0 or px >= qx:
        return True
    return rng.random() < px / qx


def _residual(p_row: np.ndarray, q_row: np.ndarray | None, x: int) -> np.ndarray:
    """normalize(max(0, p - q)), with q a point mass at x when q_row is None.

    When p == q exactly the residual is empty; the rejection then had
    probability zero, so any choice is measure-zero.  We fall back to p.
    """
    if q_row is None:
        residual = p_row.copy()
        residual[x] = 0.0
    else:
        residual = np.maximum(p_row - q_row, 0.0)
    if not residual.sum() > 0.0:
        return p_row
    return residual


def verify_tree_greedy(
    token_ids: Sequence[int], parents: Sequence[int], target_argmax: Sequence[int]
) -> tuple[VerifyResult, list[int]]:
    """Greedy verification of a token tree: follow the target's argmax down the tree.

    Rows of ``target_argmax``: row 0 is the root (the pending token), row
    i+1 is draft node i, whose parent is ``parents[i]`` (-1 = the root).
    Returns the result and the accepted node indices, root to tip, which is
    the longest path the target agrees with.

    >>> verify_tree_greedy([5, 6, 7], [-1, -1, 0], [6, 9, 1, 2])[0].token_ids
    (6, 1)
    """
    children: dict[int, dict[int, int]] = {}
    for i, (tok, par) in enumerate(zip(token_ids, parents)):
        children.setdefault(par + 1, {}).setdefault(int(tok), i + 1)
    row, path = 0, []
    while True:
        nxt = children.get(row, {}).get(int(target_argmax[row]))
        if nxt is None:
            break
        path.append(nxt - 1)
        row = nxt
    tokens = tuple(int(token_ids[i]) for i in path) + (int(target_argmax[row]),)
    return VerifyResult(token_ids=tokens, n_accepted=len(path)), path
