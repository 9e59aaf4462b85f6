"""Measured costs: the target's verification curve t(n), calibrated at load and refined online.

t(n) is the time to evaluate a batch of n tokens at the current context
depth on this machine and thread count.  On 2 cores it grows steeply past
n ~ 4 (compute-bound), which is why k must be chosen from measurements.
Calibration takes well under a second on small models and is cached on disk
(``cost_cache``) by what it depends on: model file, threads, llama.cpp build and kernel settings.  A
timing taken while the machine was busy is measured again, and not cached if it stays noisy
(``timing_noise``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from typing import Sequence, TypeVar

import numpy as np

from ..llama import BatchShapes, EngineTarget, plan_calls
from ..ui import Progress
from .cost_cache import CACHE_VERSION, cache_path, entry_key, lookup, need_dict, need_int, need_seconds, read_cache, \
    say_once, store

CURVE_VERSION = CACHE_VERSION  # bump it (in cost_cache) when a measurement method changes
K = TypeVar("K", bound=Hashable)
# Timings of one kind whose two fastest differ by more than this were disturbed by other work on the machine
# (quiet, they agree within a few percent: see ``timing_noise``), so the fastest may be too.
NOISE_LIMIT = 0.25
MEASURE_TRIES = 3  # a noisy timing is taken again up to this many times in all before it is used uncached


@dataclass
class CostModel:
    """t(T) for one llama.cpp call of T rows, T = 1..len(curve); beyond it, extrapolated linearly.

    A step's cost is priced through the same call plan the target uses
    (``target.plan_calls``): verification batches longer than the model's
    exact ``max_rows`` are split, and concurrent generations share calls, so
    a draft token is valued at its marginal cost in *that* batch.

    Online refinement: call sizes seen often enough use their own running
    estimate; the others are the calibrated curve times a running scale
    factor (observed / calibrated over all steps), so a calibration made on
    a busy machine, or a change in load, corrects sizes not tried yet.
    """

    curve: list[float]
    shapes: BatchShapes = field(default_factory=lambda: BatchShapes(min_rows=1))
    ema: float = 0.1  # weight of one online observation
    source: str = "calibrated"
    min_seen: int = 3
    # Recurrent targets: seconds a step with a draft spends beyond its call (a checkpoint, a restore
    # and re-decode), learnt online; a step without a draft pays none of it.
    rewind_s: float = 0.0
    _rewind_seen: int = 0
    _online: dict[int, float] = field(default_factory=dict)
    _seen: dict[int, int] = field(default_factory=dict)
    _scale: float = 1.0
    _dearest: list[float] = field(default_factory=list)  # running maximum of the curve

    def __post_init__(self) -> None:
        self._dearest = list(itertools.accumulate(self.curve, max))

    def adopt(self, measured: "CostModel") -> None:
        """Price with ``measured`` from now on: a calibration that finished after this object was handed to
        policies (``background``), which all share it.  What was learnt online was learnt against the
        provisional curve, so it goes too."""
        self.curve, self.shapes, self.source = list(measured.curve), measured.shapes, measured.source
        self._dearest = list(measured._dearest)
        self._online, self._seen, self._scale = {}, {}, 1.0

    def call_s(self, rows: int) -> float:
        """One call of ``rows`` rows (padded to min_rows, or to a cheaper size: ``BatchShapes.pad_to``)."""
        n = self.shapes.rows_for(max(rows, 1))
        if self._seen.get(n, 0) > self.min_seen:
            return max(self._online[n], self._floor(n))
        return self._calibrated(n) * self._scale

    def batch_s(self, rows: Sequence[int]) -> float:
        """A step in which generation i evaluates ``rows[i]`` rows (its pending token plus its draft)."""
        return self._calls_s(rows) + self.rewind_s * sum(1 for r in rows if r > 1)

    def _calls_s(self, rows: Sequence[int]) -> float:
        """The llama.cpp calls alone of such a step."""
        if len(rows) == 1 and rows[0] <= self.shapes.max_rows:
            return self.call_s(rows[0])
        calls = plan_calls(rows, range(len(rows)), self.shapes.min_rows, self.shapes.max_rows,
                           even=self.shapes.even_rows, pad_to=self.shapes.pad_to)
        return sum(self.call_s(sum(p.count + p.pad for p in call)) for call in calls)

    def observe_rewind(self, seconds: float, drafted: int) -> None:
        """A step's recurrent-state overhead, spread over its ``drafted`` generations with a draft."""
        if drafted <= 0:
            return
        per = seconds / drafted
        self._rewind_seen += 1
        first = self._rewind_seen == 1
        self.rewind_s = per if first else self.rewind_s + self.ema * (per - self.rewind_s)

    def verify_s(self, n: int) -> float:
        """One generation verifying n rows alone (split into exact calls where needed)."""
        return self.batch_s((max(n, 1),))

    def _floor(self, n: int) -> float:
        """Keep t non-decreasing: no size may look cheaper than a smaller one known online."""
        known = [self._online[m] for m in self._online if m < n and self._seen[m] > self.min_seen]
        return max(known, default=0.0)

    def _calibrated(self, n: int) -> float:
        """On the curve: as measured where calls are padded to their cheapest size (``pad_to``; n is one), else
        the dearest size up to n (a bigger call never looks cheaper).  Beyond: the mean slope of its upper
        half (the last step alone can be ~0 from noise)."""
        c = self.curve
        if n <= len(c):
            return c[n - 1] if n <= len(self.shapes.pad_to) else self._dearest[n - 1]
        half = len(c) // 2
        slope = (c[-1] - c[half - 1]) / (len(c) - half) if len(c) > 1 else c[-1]
        return c[-1] + max(slope, 0.0) * (n - len(c))

    def observe_step(self, rows: Sequence[int], seconds: float) -> None:
        """Refine from a real step's calls (seconds <= 0 means not measured; rewind time is not included)."""
        if not rows or seconds <= 0:
            return
        if len(rows) == 1 and rows[0] <= self.shapes.max_rows:
            self.observe_call(max(rows[0], self.shapes.min_rows), seconds)
            return
        predicted = self._calls_s(rows)
        ratio = min(seconds / predicted, 3.0) if predicted > 0 else 1.0
        self._scale += 0.25 * self.ema * (ratio * self._scale - self._scale)

    def observe_call(self, n: int, seconds: float) -> None:
        if n < 1 or seconds <= 0:
            return
        n = self.shapes.rows_for(n)  # the call as run
        # One step can be delayed by far more than its cost (a cold first call, the OS
        # scheduling another process): clip so that no single step dominates.
        seconds = min(seconds, 3.0 * self.call_s(n))
        self._seen[n] = self._seen.get(n, 0) + 1
        if self._seen[n] == 1:
            return  # the first batch of a new shape pays one-off graph and buffer setup
        prev = self._online.get(n)
        self._online[n] = seconds if prev is None else prev + self.ema * (seconds - prev)
        self._scale += self.ema * (seconds / self._calibrated(n) - self._scale)


def _filler(model: EngineTarget, n: int) -> list[int]:
    """Deterministic ordinary token ids (BOS first) for timing and shape probes."""
    first = model.bos_id if model.bos_id >= 0 else 0
    rng = np.random.default_rng(1234)  # varied ids: equal kernels on repetitive input can hide a difference
    return [first] + rng.integers(min(50, model.n_vocab - 1), model.n_vocab, n - 1).tolist()


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
    toks = _filler(model, depth + longest)  # the tree's nodes: any ordinary tokens after the context
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
    toks = _filler(model, depth + max(sizes, default=2))
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


def time_calls(model: EngineTarget, tokens: Sequence[int], sizes: Sequence[int], depth: int, reps: int, *,
               budget_s: float | None = None, warmup: Sequence[int] = (2,), min_reps: int = 2,
               progress: Callable[[int], None] | None = None) -> dict[int, list[float]]:
    """Seconds of one call of n rows after a ``depth``-token context, every round, for each n in ``sizes``.

    The one timing method of the cost curve (``measure_curve`` and ``bench/costcurve.py``):
    ``tokens[:depth]`` are prefilled and checkpointed, then each round calls every n in turn
    (interleaved, so machine noise spreads over all of them), each call unsplit and padded to
    the model's ``min_rows``.  Only the call is timed: cutting a recurrent state back is priced
    apart (``CostModel.rewind_s``).  ``warmup`` sizes run first, untimed (first calls allocate
    compute buffers).  Stops after ``budget_s`` (if given) once every n has ``min_reps`` samples: two, so
    that ``timing_noise`` can tell a quiet machine from a busy one.  ``progress`` is told how many timed
    calls are done after each (a long curve, as ``bench`` measures, takes a minute).
    """
    pad = model.min_batch
    model.reset()
    model.prefill(tokens[:depth])
    model.checkpoint(0)

    def call(n: int) -> float:
        with model.gate:  # a background measurement times its calls only once it has the cores
            t0 = time.perf_counter()
            model.raw_call(tokens[depth : depth + n], pad=max(0, pad - n))
            spent = time.perf_counter() - t0
        model.truncate(depth)
        return spent

    for n in warmup:
        call(n)
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    start = time.perf_counter()
    for rep in range(1, reps + 1):
        for i, n in enumerate(sizes, start=1):
            samples[n].append(call(n))
            if progress is not None:
                progress((rep - 1) * len(sizes) + i)
        if budget_s is not None and rep >= min_reps and time.perf_counter() - start > budget_s:
            break
    model.reset()
    return samples


def measure_curve(model: EngineTarget, n_max: int, depth: int = 128, reps: int = 5, budget_s: float = 1.0) -> list[float]:
    """Time of one call of n rows after ``depth`` context tokens, n = 1..n_max.

    Calls are unsplit and padded to the model's ``min_rows`` (the engine
    prices longer batches through the call plan).  Rounds sweep all n in
    turn and each n keeps its *minimum*: on a shared machine interference
    only ever adds time, so the minimum is the most faithful estimate.
    Stops after ``budget_s`` once every n has two samples.
    """
    return _measure_curve(model, n_max, depth, reps, budget_s, tries=1)[0]


def curve_depth(model: EngineTarget, n_max: int, depth: int = 128) -> int:
    """The context depth the cost curve is timed at: ``depth``, unless the context is too small for it."""
    return max(1, min(depth, model.capacity - n_max - 1))


def _measure_curve(model: EngineTarget, n_max: int, depth: int = 128, reps: int = 5, budget_s: float = 1.0,
                   tries: int = MEASURE_TRIES) -> tuple[list[float], float]:
    """``measure_curve``, timed again while the machine looks busy (``steady``); also returns the noise left."""
    depth = curve_depth(model, n_max, depth)
    # every size up to 24: kernels that take rows in groups make the curve saw-toothed (``cheapest_sizes``)
    sizes = [n for n in (*range(1, 25), 32, 48, 64) if n < n_max] + [n_max]
    toks = _filler(model, depth + n_max)
    # the typical size judged, not the worst: of 20-odd sizes one is often disturbed even on a quiet machine,
    # and a size priced too dear is corrected online (``CostModel.observe_call``)
    samples, noise = steady(lambda: time_calls(model, toks, sizes, depth, reps, budget_s=budget_s), tries, quantile=0.5)
    best = {n: min(ts, default=float("inf")) for n, ts in samples.items()}
    return _interpolate(best, n_max), noise


def timing_noise(samples: Mapping[Hashable, Sequence[float]], quantile: float = 1.0) -> float:
    """How much other work on the machine may have added to the fastest timing of a kind (its second fastest
    over it, less one), at ``quantile`` over the kinds: 1.0 the worst kind, 0.5 the typical one.  0 where no
    kind has two timings.

    Each measurement keeps the fastest of its repetitions, as interference only ever adds time.  That is
    faithful when the fastest timing was undisturbed, and two undisturbed timings agree closely.  Under heavy
    load (every timing delayed, by different amounts) they do not: the verdict "a padded one-token step costs
    +1156%" on pycoder-6m was measured so, and cached for good.  Seen here at a load average of 5 on 2 cores:
    Gemma 3 270M's kinds spread by 10-410% (its pad cost came out anywhere from -42% to +73%), the bundled
    target's (1 ms calls) by 0-15%.
    """
    spreads = sorted(_spread(ts) for ts in samples.values() if len(ts) >= 2)
    if not spreads:
        return 0.0
    return spreads[min(len(spreads) - 1, math.ceil(quantile * len(spreads)) - 1)] if quantile < 1 else spreads[-1]


def _spread(times: Sequence[float]) -> float:
    first, second = sorted(times)[:2]
    return second / first - 1 if first > 0 else math.inf


def steady(measure: Callable[[], dict[K, list[float]]], tries: int = MEASURE_TRIES,
           quantile: float = 1.0) -> tuple[dict[K, list[float]], float]:
    """Timings from ``measure``, taken again (their samples pooled) while their ``timing_noise`` at ``quantile``
    is above ``NOISE_LIMIT``, ``tries`` times at most; returns them and the noise left.

    Pooling, not replacing: a busy spell that ends mid-measurement leaves quiet timings in the pool, and the
    fastest two are what is judged.  Bounded, since a machine busy for good must still get a cost model.
    """
    samples = measure()
    for _ in range(tries - 1):
        if timing_noise(samples, quantile) <= NOISE_LIMIT:
            break
        more = measure()
        samples = {k: samples[k] + more.get(k, []) for k in samples}
    return samples, timing_noise(samples, quantile)


def _cacheable(model: EngineTarget, what: str, noise: float) -> bool:
    """Whether timings with ``noise`` may be cached; where not, it is said once for this run."""
    if noise <= NOISE_LIMIT:
        return True
    shown = "an unbounded amount" if math.isinf(noise) else f"{100 * noise:.0f}%"
    say_once(f"noisy:{model.path}", f"the machine was busy while timing {what} of {Path(str(model.path)).name} "
             f"(repeated timings differed by {shown} after {MEASURE_TRIES} tries); using them for this run only: "
             "they are not cached, and the next run measures again")
    return False


_checked: set[tuple[Path, str]] = set()  # cached curves this process has checked (a bench builds many policies)


def _still_true(model: EngineTarget, cached: CostModel, tolerance: float = 5.0) -> bool:
    """Whether a cached curve still describes this machine: one-row calls timed now (a short context,
    the fastest of five) are within ``tolerance`` x of its t(1).

    A curve measured while other processes held the cores (llama.cpp's thread pool then stalls,
    here up to 3000x) would otherwise price every draft wrongly for as long as the cache lives.
    """
    depth = max(1, min(16, model.capacity - 2))
    now = min(time_calls(model, _filler(model, depth + 1), [1], depth, reps=5)[1])
    return 1 / tolerance <= now / cached.call_s(1) <= tolerance


def _interpolate(points: dict[int, float], n_max: int) -> list[float]:
    """t(1..n_max) from measured sizes, linear between them.  Not smoothed: a size can cost more than a
    bigger one (``cheapest_sizes``); ``CostModel`` prices each size as the target will run it."""
    xs = sorted(points)
    curve = []
    for n in range(1, n_max + 1):
        hi = next(x for x in xs if x >= n)
        lo = max((x for x in xs if x <= n), default=hi)
        t = points[lo] if hi == lo else points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo)
        curve.append(t)
    return curve


def cheapest_sizes(curve: Sequence[float], margin: float = 0.03) -> tuple[int, ...]:
    """For n = 1..len(curve): the call size m >= n to pad n rows to, the cheapest on the measured ``curve``
    (``BatchShapes.pad_to``); m = n unless m is more than ``margin`` cheaper (noise must not add rows).

    >>> cheapest_sizes([23.5, 56.7, 69.4, 77.1, 103.7, 115.0, 127.5, 103.6])
    (1, 2, 3, 4, 5, 8, 8, 8)
    """
    out = []
    for n in range(1, len(curve) + 1):
        m = min(range(n, len(curve) + 1), key=lambda k: (curve[k - 1], k))
        out.append(m if curve[m - 1] < (1 - margin) * curve[n - 1] else n)
    return tuple(out)


def shapes_key(model: EngineTarget, trees: bool | None = None) -> str:
    """The cache key of ``measure_shapes`` on ``model``: its machine key (``cost_cache.machine_key``) and what
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


EXACT_MODES = ("auto", "on", "off")
# --exact auto keeps exact calls where they cost at most this share of the calls they replace.  Below
# it the price of bit-identity is within this machine's run-to-run noise; above it (a pad row that
# costs most of a step, as on Gemma 3 at 1-2 threads, or verification split into many calls) the
# speed is worth more to most users than identity at near-ties, which no peer offers either.
AUTO_EXACT_LIMIT = 0.03


@dataclass(frozen=True)
class ExactCost:
    """What exact call shapes cost on this model and thread count, as fractions of the calls they replace.

    pad: a one-token step padded to ``min_rows`` over an unpadded one-row step.
    split: a ``rows``-row verification split into calls of at most ``max_rows`` over one call.
    """

    pad: float
    split: float
    rows: int
    noise: float = field(default=0.0, compare=False)  # ``timing_noise`` of the timings (not cached)

    @classmethod
    def parse(cls, entry: object) -> "ExactCost":
        """A cached verdict, checked (``cost_cache``): shares >= 0 and a row count, else ValueError."""
        d = need_dict(entry, ("pad", "split", "rows"))
        return cls(pad=need_seconds(d["pad"], "pad", positive=False), split=need_seconds(d["split"], "split", positive=False),
                   rows=need_int(d["rows"], "rows", 2))

    def entry(self) -> dict:
        return {"pad": self.pad, "split": self.split, "rows": self.rows}

    @property
    def worst(self) -> float:
        return max(self.pad, self.split)

    def describe(self) -> str:
        return (f"a padded one-token step costs {100 * self.pad:+.0f}%, a {self.rows}-row verification split "
                f"into exact calls {100 * self.split:+.0f}%")


def exact_mode(exact: bool | str) -> str:
    """``--exact`` as one of ``EXACT_MODES`` (True/False, as in older roles files, mean on/off)."""
    mode = ("on" if exact else "off") if isinstance(exact, bool) else exact
    if mode not in EXACT_MODES:
        from ..errors import InvalidParameterError

        raise InvalidParameterError(f"exact must be one of {', '.join(EXACT_MODES)} (got {exact!r})")
    return mode


def ensure_shapes(model: EngineTarget, exact: bool | str = "on", use_cache: bool = True,
                  show_progress: bool = True) -> BatchShapes:
    """Give ``model`` its call shapes for ``--exact`` (``exact_mode``): measured exact shapes, cached on disk
    next to the cost curves (on); none (off: no padding and no splitting, fastest, but speculative output may
    then differ from plain decoding where llama.cpp's numerics depend on the call shape); or, for auto, the
    exact shapes where ``measure_exact_cost`` finds them within ``AUTO_EXACT_LIMIT``, else none.  The
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
    from ..llama import INEXACT

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
    if _free(model, shapes):
        return _auto_verdict(model, shapes, None)
    key = exact_cost_key(model, shapes)
    cost = lookup(cache, key, ExactCost.parse, path)
    if cost is None:
        if not measure:
            return None
        cost = measure_exact_cost(model, shapes)
        if use_cache and _cacheable(model, "what exactness costs", cost.noise):
            store(path, key, cost.entry())
    return _auto_verdict(model, shapes, cost)


def _free(model: EngineTarget, shapes: BatchShapes) -> bool:
    """Exact shapes that constrain nothing: no pad, no split."""
    return shapes.min_rows == 1 and shapes.max_rows >= model.batch_cap


def _auto_verdict(model: EngineTarget, shapes: BatchShapes, cost: ExactCost | None) -> BatchShapes:
    """``--exact auto``: the measured exact ``shapes`` if they cost little here (``cost``; None: free), else none."""
    from ..llama import INEXACT

    if cost is None:
        return dataclasses.replace(shapes, why="--exact auto: on, every call shape is exact on this model (free)")
    where = f"{Path(str(model.path)).name} at {model.n_threads} thread{'' if model.n_threads == 1 else 's'}"
    if cost.worst <= AUTO_EXACT_LIMIT:
        return dataclasses.replace(shapes, why=f"--exact auto: on, exactness costs little on {where} ({cost.describe()})")
    return dataclasses.replace(INEXACT, why=f"--exact auto: off, exactness would cost too much on {where} "
                               f"({cost.describe()}; the limit is {100 * AUTO_EXACT_LIMIT:.0f}%); greedy output may "
                               "differ from plain decoding at near-ties; --exact on keeps it identical")


def _exact_cost_plan(model: EngineTarget, depth: int = 128, rows: int = 17) -> tuple[int, int]:
    """The rows and context depth ``measure_exact_cost`` times on ``model`` (a small context bounds both)."""
    rows = max(2, min(rows, model.batch_cap, model.capacity - depth - 1))
    return rows, max(1, min(depth, model.capacity - rows - 1))


def exact_cost_key(model: EngineTarget, shapes: BatchShapes) -> str:
    """The cache key of ``measure_exact_cost``: the machine key and what is timed (the rows, their depth, and
    the calls ``shapes`` make of them)."""
    rows, depth = _exact_cost_plan(model)
    scope = {"rows": rows, "depth": depth, "min_rows": shapes.min_rows, "chunk": min(shapes.max_rows, rows),
             "pad_logits": shapes.pad_logits}
    return entry_key("exact-auto-", model, scope)


def measure_exact_cost(model: EngineTarget, shapes: BatchShapes, depth: int = 128, rows: int = 17,
                       reps: int = 7, budget_s: float = 0.5, tries: int = MEASURE_TRIES) -> ExactCost:
    """Time what ``shapes`` add over unconstrained calls (``ExactCost``), interleaved, each kind's minimum.

    Both sides of each comparison run in the same round, so load on a shared machine spreads over both;
    the minimum of the rounds is the least disturbed sample of each.  Timed again while the machine looks
    busy (``steady``); ``ExactCost.noise`` says how noisy the timings stayed.
    """
    rows, depth = _exact_cost_plan(model, depth, rows)
    samples, noise = steady(lambda: _time_exact_kinds(model, shapes, depth, rows, reps, budget_s), tries)
    best = {k: min(v) for k, v in samples.items()}
    split = rows > shapes.max_rows  # verification of ``rows`` rows is cut into several calls
    return ExactCost(pad=max(0.0, best["padded"] / best["plain"] - 1),
                     split=max(0.0, best["split"] / best["whole"] - 1) if split else 0.0, rows=rows, noise=noise)


def _time_exact_kinds(model: EngineTarget, shapes: BatchShapes, depth: int, rows: int, reps: int,
                      budget_s: float) -> dict[str, list[float]]:
    """Seconds of each kind of call ``measure_exact_cost`` compares, every round (two rounds at least)."""
    toks = _filler(model, depth + rows)
    model.reset()
    model.prefill(toks[:depth])
    model.checkpoint(0)
    pad = max(0, shapes.min_rows - 1)
    chunks = [toks[depth + i : depth + min(i + shapes.max_rows, rows)] for i in range(0, rows, shapes.max_rows)]

    def timed(calls: Sequence[tuple[Sequence[int], int]]) -> float:
        with model.gate:
            t0 = time.perf_counter()
            for part, p in calls:
                model.raw_call(part, pad=p, pad_logits=shapes.pad_logits)
            spent = time.perf_counter() - t0
        model.truncate(depth)
        return spent

    kinds = {"plain": [(toks[depth : depth + 1], 0)], "padded": [(toks[depth : depth + 1], pad)],
             "whole": [(toks[depth : depth + rows], 0)],
             "split": [(c, max(0, shapes.min_rows - len(c))) for c in chunks]}
    for calls in kinds.values():  # first calls of a shape allocate buffers
        timed(calls)
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    start = time.perf_counter()
    for rep in range(1, reps + 1):
        for k, calls in kinds.items():
            samples[k].append(timed(calls))
        if rep >= 2 and time.perf_counter() - start > budget_s:
            break
    model.reset()
    return samples


def curve_key(model: EngineTarget, n_max: int) -> tuple[int, str]:
    """The curve ``calibrate`` measures for ``n_max`` (widened for several slots, capped by a batch) and its
    cache key: the machine key and what the timed calls are (their padding, their depth).  Not n_max: a
    cached curve at least that long serves it (its first n_max sizes are timed alike)."""
    n_max = min(max(n_max, min(64, 4 * model.n_slots)), model.batch_cap)  # no call wider than a batch (-c 10)
    scope = {"min_rows": model.shapes.min_rows, "pad_logits": model.shapes.pad_logits,
             "depth": curve_depth(model, n_max)}
    return n_max, entry_key("curve-", model, scope)


def _parse_curve(entry: object, n_max: int) -> list[float] | None:
    """A cached curve's first ``n_max`` times, checked (``cost_cache``); None where it is shorter."""
    curve = need_dict(entry, ("curve_s",))["curve_s"]
    if not isinstance(curve, list) or not curve:
        raise ValueError(f"curve_s is {curve!r}, not a list of seconds")
    times = [need_seconds(t, f"curve_s[{i}]") for i, t in enumerate(curve)]
    return times[:n_max] if len(times) >= n_max else None


def _cached_curve(model: EngineTarget, n_max: int) -> tuple[str, list[float] | None]:
    """``curve_key``'s key and the cached curve for ``n_max`` under it (None: not cached, or damaged)."""
    n_max, key = curve_key(model, n_max)
    path = cache_path()
    return key, lookup(read_cache(path), key, lambda e: _parse_curve(e, n_max), path)


def curve_cached(model: EngineTarget, n_max: int) -> bool:
    """Whether ``calibrate`` would find the curve in the disk cache (under the model's shapes)."""
    return _cached_curve(model, n_max)[1] is not None


def calibrate(model: EngineTarget, n_max: int = 17, use_cache: bool = True, exact: bool | str = True) -> CostModel:
    """Exact shapes and t(n) for this model, machine and thread count: from the disk cache or measured now.

    With several slots the curve reaches further (calls then carry many generations' rows).
    """
    ensure_shapes(model, exact, use_cache)
    key, cached = _cached_curve(model, n_max) if use_cache else (curve_key(model, n_max)[1], None)
    n_max = curve_key(model, n_max)[0]
    path = cache_path()
    if cached is not None:
        costs = CostModel(cached, shapes=model.shapes, source="cache")
        if (path, key) in _checked or _still_true(model, costs):
            _checked.add((path, key))
            return _padded(model, costs)
    curve, noise = _measure_curve(model, n_max)
    _checked.add((path, key))  # measured by this process: nothing to check against
    if use_cache and _cacheable(model, "its cost curve", noise):
        store(path, key, {"model": str(model.path), "threads": model.n_threads, "curve_s": curve, "measured": time.time()})
    return _padded(model, CostModel(curve, shapes=model.shapes))


def _padded(model: EngineTarget, costs: CostModel) -> CostModel:
    """Without exactness, the target pads each call to its cheapest size on the curve (``BatchShapes.pad_to``),
    and the cost model prices it so."""
    one_graph = model.n_slots == 1 or not model.shapes.even_rows  # separate streams pad evenly, never per pad_to
    if model.shapes.exact or model.is_recurrent or not one_graph:  # a recurrent model's pads are phantoms: not free
        return costs
    model.set_shapes(dataclasses.replace(model.shapes, pad_to=cheapest_sizes(costs.curve)))
    costs.shapes = model.shapes
    return costs
