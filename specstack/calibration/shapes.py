"""Exact call shapes: which llama.cpp call sizes compute every row exactly as plain decoding, per model.

``measure_shapes`` probes them (once per model, thread count and machine), ``ensure_shapes`` gives a target
the shapes of its ``--exact`` mode (``modes``) from the disk cache (``cache``) or measured now, and
``cached_shapes`` says what the cache alone holds.  See ``BatchShapes`` for what the shapes mean.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import numpy as np

from ..llama import INEXACT, BatchShapes, EngineTarget
from ..ui import Progress
from .cache import cache_path, entry_key, lookup, read_cache, store
from .modes import ExactCost, auto_verdict, exact_cost_key, exact_mode, is_free, measure_exact_cost
from .timing import cached, filler, kept_entry


DEEP_PROBE = 640  # the deeper KV depth of the shape probe (see ``probe_depths``)


def probe_depths(model: EngineTarget, n_probe: int) -> tuple[int, int]:
    """The two KV depths the shape probe runs at: 160, and past both llama.cpp's 256-cell KV padding and the
    model's sliding window (640, or window + 128), never the whole context.

    Why a bounded depth is enough: with flash attention off (the default), no CPU kernel picks its path by KV
    length: the KQ and KQV products run the same kernel for any number of cells, and their per-row sums are
    ordered by cell index alone.  What can change with depth is the mask, which a depth past the sliding window
    exercises, and llama.cpp's KV padding to 256 cells, which 640 crosses twice.  Probing at the full context,
    as before, prefilled 32,000 tokens for a 32k model and took minutes.
    """
    room = max(1, model.n_ctx - n_probe - 2)
    window = int(getattr(model, "n_swa", 0) or 0)
    deep = max(DEEP_PROBE, window + 128)
    return min(160, room), min(deep, room)


def measure_shapes(model: EngineTarget, n_ref: int = 24, probes: Sequence[int] = (32, 48, 64, 128),
                   depths: Sequence[int] | None = None, show_progress: bool = False) -> BatchShapes:
    """Which call shapes compute every row exactly as plain decoding (see ``BatchShapes``).

    After ``depth`` prompt tokens, the reference is plain decoding of the next tokens one call at a time,
    unpadded (``ref1``) and padded to two rows (``ref2``).  Calls of T = 2..n_ref tokens, then the larger
    ``probes``, are compared with it bit for bit on *every* row (a kernel that works in row groups can go
    wrong only in a late row: a 19-row Q8_0 call did on an AVX2 machine).  A size counts as exact only if it
    matches at both depths (``probe_depths``).  Sizes are tried in order and the probe stops once neither
    reference can extend its run of exact sizes, so a model whose calls stop being exact at 4 rows (Q4_K_M
    here) costs a dozen calls per depth, not a hundred.  The reference that admits the longer run wins
    (unpadded on ties), and ``max_rows`` is the end of that run.  Padded plain decoding is also run with no
    logits asked of the pad (``BatchShapes.pad_logits``): where its rows equal the padded reference's at both
    depths, pads go without.  ``show_progress`` shows a ``ui.Progress`` on stderr (a line even when stderr is
    not a terminal).
    """
    n_ref, all_sizes, depths = _shape_plan(model, n_ref, probes, depths)
    match1: dict[int, bool] = {1: True}
    match2: dict[int, bool] = {2: True}
    same = lean = True
    trees: dict[int, bool] = {}
    progress = Progress(f"measuring exact call shapes of {Path(str(model.config.path)).name} (once per model, cached)",
                        len(depths), "KV depths", quiet=not show_progress, interval=0.0)
    for i, want in enumerate(depths):
        sizes = [t for t in all_sizes if t <= model.n_ctx - want - 1 and (i == 0 or match1.get(t) or match2.get(t))]
        progress.update(i, f"at {want} tokens")
        m1, m2, s1, lean1, trees1 = _match_at(model, want, sizes, n_ref)
        for n, ok in trees1.items():
            trees[n] = trees.get(n, True) and ok
        for t in all_sizes:
            match1[t] = match1.get(t, True) and m1.get(t, False)
            match2[t] = match2.get(t, True) and m2.get(t, False)
        same, lean = same and s1, lean and lean1
    progress.close()

    def run(match: dict[int, bool], first: int) -> int:
        last = first
        for t in [s for s in all_sizes if s >= first]:
            if not match.get(t, False):
                break
            last = t
        return last

    end1, end2 = run(match1, 1), run(match2, 2)
    min_rows, end = (1, end1) if same or end1 >= end2 else (2, end2)
    unbounded = end == all_sizes[-1]
    max_rows = model.batch_cap if unbounded else end
    fitting = [ok for n, ok in trees.items() if n <= max_rows]
    return BatchShapes(min_rows=min_rows, max_rows=max_rows, prefill_exact=unbounded, settled=True,
                       pad_logits=min_rows == 1 or not lean, tree_exact=all(fitting) if fitting else None)


def _shape_plan(model: EngineTarget, n_ref: int = 24, probes: Sequence[int] = (32, 48, 64, 128),
                depths: Sequence[int] | None = None) -> tuple[int, list[int], list[int]]:
    """``measure_shapes``'s reference length, call sizes and KV depths on ``model``: what a small context or
    batch bounds, and so the scope of its cache entry (``shapes_key``)."""
    n_ref = max(2, min(n_ref, model.batch_cap))
    all_sizes = list(range(2, n_ref + 1)) + [p for p in probes if n_ref < p <= model.batch_cap]
    depths = list(depths) if depths is not None else list(probe_depths(model, max(all_sizes)))
    return n_ref, all_sizes, depths


# Tree layouts the shape probe verifies (parents, as ``eval_tree`` takes them): a fork at the root, a
# fork below it, a bushy tree, and one as deep as 12 nodes; sizes fall on both sides of a 4-row group.
TREE_PROBES: tuple[tuple[int, ...], ...] = (
    (-1, 0, 0),
    (-1, 0, 0, 2),
    (-1, 0, 1, 0, 3, 1),
    (-1, 0, 0, 0, 1, 2, 3, 4, 5),
    (-1, 0, 1, 2, 3, 4, 5, 0, 7, 8, 1, 10),
)


def _trees_at(model: EngineTarget, depth: int, max_rows: int) -> dict[int, bool]:
    """Per probed tree size: do a tree's rows equal, branch by branch, a chain call of that branch after the
    ``depth`` tokens sequence 0 holds?  A tree call lays its rows out, masks and sizes its batch unlike any chain, so whether tree
    verification is exact is measured, not assumed: on an AVX2 build a 4-node F16 tree differed by ~4e-4.  A
    chain within the exact shapes equals plain decoding, so a matching tree of that size does too.  Empty
    where the target cannot verify trees (one sequence, recurrent); trees of more than ``max_rows`` nodes (no
    exact chain to compare with) are skipped."""
    if model.n_seq_max < 2 or not model.unified or model.is_recurrent:
        return {}
    longest = max(len(p) for p in TREE_PROBES)
    toks = filler(model, depth + longest)  # the tree's nodes: any ordinary tokens after the context
    result: dict[int, bool] = {}
    for parents in TREE_PROBES:
        n = len(parents)
        leaves = [i for i in range(n) if i not in parents]
        if n > min(max_rows, model.batch_cap) or len(leaves) > model.n_seq_max or depth + n + 1 > model.capacity:
            continue
        nodes = toks[depth : depth + n]
        rows = model.eval_tree(nodes, parents).copy()
        model.commit_tree([0])
        model.truncate(depth)
        ok = True
        for leaf in leaves:
            path = [leaf]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            path.reverse()
            chain = model.raw_call([nodes[i] for i in path], pad=max(0, model.min_batch - len(path)))
            ok = ok and bool(np.array_equal(rows[path], chain[: len(path)]))
            model.truncate(depth)
        result[n] = ok
    return result


def _match_at(model: EngineTarget, depth: int, sizes: Sequence[int],
              n_ref: int) -> tuple[dict[int, bool], dict[int, bool], bool, bool, dict[int, bool]]:
    """Per size (in order): do all its rows equal the unpadded (1) / padded (2) plain references after ``depth``
    tokens?  Stops at the first size where both runs have broken.  The references grow only as far as a live
    run needs: 6 rows, then ``n_ref``, then the largest probe.  Also returns whether the two references agree,
    whether padded plain decoding with no logits asked of the pad equals the padded reference (6 rows), and
    ``_trees_at``'s verdicts at this depth."""
    toks = filler(model, depth + max(sizes, default=2))
    model.reset()
    model.prefill(toks[:depth])
    model.checkpoint(0)  # a recurrent model comes back here by restoring its state
    ref1 = ref2 = np.empty((0, model.n_vocab), dtype=np.float32)
    same = True
    lean = None
    m1: dict[int, bool] = {}
    m2: dict[int, bool] = {}
    ok1 = ok2 = True
    for t in sizes:
        if t > len(ref1) and t > len(ref2):
            n = min(next(g for g in (6, n_ref, max(sizes)) if g >= t), max(sizes))
            ref1 = _plain_rows(model, toks, depth, n, pad=0) if ok1 else ref1
            ref2 = _plain_rows(model, toks, depth, n, pad=1) if ok2 else ref2
            if ok1 and ok2:
                same = same and bool(np.array_equal(ref1, ref2))
            if lean is None:
                lean = bool(np.array_equal(_plain_rows(model, toks, depth, len(ref2), pad=1, pad_logits=False), ref2))
        rows = model.raw_call(toks[depth : depth + t])
        ok1 = m1[t] = ok1 and bool(np.array_equal(rows, ref1[:t]))
        ok2 = m2[t] = ok2 and bool(np.array_equal(rows, ref2[:t]))
        model.truncate(depth)
        if not ok1 and not ok2:
            break
    trees = _trees_at(model, depth, max([t for t in m1 if m1[t] or m2.get(t)], default=1))
    model.reset()
    return m1, m2, same, bool(lean), trees


def _plain_rows(model: EngineTarget, toks: Sequence[int], depth: int, n: int, pad: int,
                pad_logits: bool = True) -> np.ndarray:
    """Logits of ``n`` tokens after ``depth`` decoded one call at a time (``pad`` throw-away rows each)."""
    rows = np.stack([model.raw_call([toks[depth + j]], pad=pad, pad_logits=pad_logits)[0].copy() for j in range(n)])
    model.truncate(depth)
    return rows


def shapes_key(model: EngineTarget, trees: bool | None = None) -> str:
    """The cache key of ``measure_shapes`` on ``model``: its machine key (``cache.machine_key``) and what
    bounds the probe (its call sizes and KV depths, which only a small context or batch changes), and whether
    it probes trees (``trees``; by default, whether ``model`` can verify them)."""
    _, sizes, depths = _shape_plan(model)
    trees = _verifies_trees(model) if trees is None else trees
    return entry_key("shapes-", model, {"sizes": sizes, "depths": depths, "trees": trees})


def _verifies_trees(model: EngineTarget) -> bool:
    """Whether ``model`` can verify tree drafts (several branches on one unified cache), so its shapes probe trees."""
    return model.n_seq_max >= 2 and model.unified and not model.is_recurrent


def _cached_shapes_entry(cache: dict, model: EngineTarget, path: Path) -> BatchShapes | None:
    """Measured shapes for ``model`` from ``cache``: its own entry, else, for a model that verifies no trees
    (several slots on separate streams), one a tree-verifying run measured (the same probe, plus trees)."""
    shapes = lookup(cache, shapes_key(model), _parse_shapes, path)
    if shapes is None and not _verifies_trees(model):
        shapes = lookup(cache, shapes_key(model, trees=True), _parse_shapes, path)
        shapes = dataclasses.replace(shapes, tree_exact=None) if shapes is not None else None
    return shapes


def _shapes_entry(shapes: BatchShapes) -> dict:
    """Measured shapes as cached: a ``max_rows`` that no probe bounded is stored as unbounded, so a target
    with a larger batch does not split calls at this one's batch size (``set_shapes`` caps it to each)."""
    unbounded = shapes.prefill_exact
    return {**shapes.to_dict(), "max_rows": BatchShapes().max_rows if unbounded else shapes.max_rows, "why": ""}


def _parse_shapes(entry: object) -> BatchShapes:
    return dataclasses.replace(BatchShapes.from_dict(entry), settled=True, pending=False)


def ensure_shapes(model: EngineTarget, exact: bool | str = "on", use_cache: bool = True,
                  show_progress: bool = True) -> BatchShapes:
    """Give ``model`` its call shapes for ``--exact`` (``exact_mode``): measured exact shapes, cached on disk
    next to the cost curves (on); none (off: no padding and no splitting, fastest, but speculative output may
    then differ from plain decoding where llama.cpp's numerics depend on the call shape); or, for auto, the
    exact shapes where ``modes.measure_exact_cost`` finds them within ``modes.AUTO_EXACT_LIMIT``, else none.  The
    choice and its reason are in ``shapes.why``.  Shapes already settled are kept.
    """
    if model.shapes.settled:
        return model.shapes
    model.set_shapes(_exact_shapes(model, exact_mode(exact), use_cache, measure=True, show_progress=show_progress))
    return model.shapes


def cached_shapes(model: EngineTarget, exact: bool | str) -> BatchShapes | None:
    """What ``ensure_shapes`` gives, from the disk cache alone; None where it would measure."""
    return _exact_shapes(model, exact_mode(exact), use_cache=True, measure=False)


def _exact_shapes(model: EngineTarget, mode: str, use_cache: bool, measure: bool,
                  show_progress: bool = False) -> BatchShapes | None:
    """The shapes of ``--exact mode``: from the cache, else measured and stored (or None, unless ``measure``)."""
    if mode == "off":
        return INEXACT
    path = cache_path()
    cache = read_cache(path) if use_cache else {}
    shapes = _cached_shapes_entry(cache, model, path)
    if shapes is None:
        if not measure:
            return None
        shapes = _parse_shapes(_shapes_entry(measure_shapes(model, show_progress=show_progress)))
        if use_cache:
            store(path, shapes_key(model), _shapes_entry(shapes))
    shapes = dataclasses.replace(shapes, why="--exact on")
    if mode == "on":
        return shapes
    if is_free(model, shapes):
        return auto_verdict(model, shapes, None)
    key = exact_cost_key(model, shapes)
    cost = cached(cache, key, ExactCost.parse, path, model, "what exactness costs")
    if cost is None:
        if not measure:
            return None
        cost = measure_exact_cost(model, shapes)
        if use_cache:
            store(path, key, kept_entry(model, "what exactness costs", cost.entry(), cost.noise, cost.busy))
    return auto_verdict(model, shapes, cost)
