"""The cost curve: t(n), seconds of one target call of n rows on this machine and thread count.

t(n) is the time to evaluate a batch of n tokens at the current context depth.  On 2 cores it grows
steeply past n ~ 4 (compute-bound), which is why k must be chosen from measurements.  ``calibrate`` gives
the cost policy's ``CostModel`` from the disk cache (``cache``, keyed by what the curve depends on: model
file, threads, llama.cpp build and kernel settings) or measures it now, well under a second on small models;
a timing taken while the machine was busy is measured again, and not cached if it stays noisy (``timing``).
``bench_curve`` is bench's longer curve, timed by the same method (``timing.time_calls``), with its median.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from ..draft_length.costs import CostModel
from ..llama import EngineTarget, LlamaModel, ModelConfig
from ..ui import Progress
from .cache import cache_path, entry_key, lookup, need_dict, need_seconds, read_cache, store
from .shapes import ensure_shapes
from .timing import MEASURE_TRIES, busy_reason, cached, filler, kept_entry, steady_watched, time_calls


def curve_key(model: EngineTarget, n_max: int, flash_attn: bool | None = None) -> tuple[int, str]:
    """The curve ``calibrate`` measures for ``n_max`` (widened for several slots, capped by a batch) and its
    cache key: the machine key and what the timed calls are (their padding, their depth).  Not n_max: a
    cached curve at least that long serves it (its first n_max sizes are timed alike).  ``flash_attn``: the
    key as with flash attention set so (None: as the model has it)."""
    n_max = min(max(n_max, min(64, 4 * model.n_slots)), model.batch_cap)  # no call wider than a batch (-c 10)
    scope = {"min_rows": model.shapes.min_rows, "pad_logits": model.shapes.pad_logits,
             "depth": curve_depth(model, n_max), "deep": DEEP_DEPTH}  # not the context's: a slope is a slope
    return n_max, entry_key("curve-", model, scope, flash_attn)


def _parse_curve(entry: object, n_max: int) -> tuple[list[float], float] | None:
    """A cached curve's first ``n_max`` times and its row cost per context token (``CostModel.row_depth_s``),
    checked (``cache``); None where it is shorter."""
    fields = need_dict(entry, ("curve_s", "row_depth_s"))
    curve = fields["curve_s"]
    if not isinstance(curve, list) or not curve:
        raise ValueError(f"curve_s is {curve!r}, not a list of seconds")
    times = [need_seconds(t, f"curve_s[{i}]") for i, t in enumerate(curve)]
    slope = need_seconds(fields["row_depth_s"], "row_depth_s", positive=False)
    return (times[:n_max], slope) if len(times) >= n_max else None


def _cached_curve(model: EngineTarget, n_max: int) -> tuple[str, tuple[list[float], float] | None]:
    """``curve_key``'s key and the cached curve for ``n_max`` under it (None: not cached, or damaged).

    A target with flash attention whose own curve is not cached reads the one measured without it: ``-fa auto``
    reopens a target with flash attention once auto's verdict is off (``open_for_mode``), so its first run
    measured the curve without, and its second would have measured it again beside its first generations,
    for a difference of a few percent a call (4-5% on Gemma 3 270M at -t 1) that the online refinement
    (``CostModel.observe_call``) corrects anyway."""
    n_max, key = curve_key(model, n_max)
    path = cache_path()
    cache = read_cache(path)
    curve = cached(cache, key, lambda e: _parse_curve(e, n_max), path, model, "its cost curve")
    if curve is None and getattr(model, "flash_attn", False):
        twin = curve_key(model, n_max, flash_attn=False)[1]
        curve = cached(cache, twin, lambda e: _parse_curve(e, n_max), path, model, "its cost curve")
    return key, curve


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
    depth0 = curve_depth(model, n_max)
    if cached is not None:
        costs = CostModel(cached[0], shapes=model.shapes, source="cache", depth0=depth0, row_depth_s=cached[1])
        if (path, key) in _checked or _still_true(model, costs):
            _checked.add((path, key))
            return _padded(model, costs)
    curve, slope, busy = _measure_curve(model, n_max)
    _checked.add((path, key))  # measured by this process: nothing to check against
    if use_cache:
        entry = {"model": str(model.path), "threads": model.n_threads, "curve_s": curve, "row_depth_s": slope,
                 "measured": time.time()}
        store(path, key, kept_entry(model, "its cost curve", entry, 0.0, busy))
    return _padded(model, CostModel(curve, shapes=model.shapes, depth0=depth0, row_depth_s=slope))


def _padded(model: EngineTarget, costs: CostModel) -> CostModel:
    """Without exactness, the target pads each call to its cheapest size on the curve (``BatchShapes.pad_to``),
    and the cost model prices it so."""
    one_graph = model.n_slots == 1 or not model.shapes.even_rows  # separate streams pad evenly, never per pad_to
    if model.shapes.exact or model.is_recurrent or not one_graph:  # a recurrent model's pads are phantoms: not free
        return costs
    model.set_shapes(dataclasses.replace(model.shapes, pad_to=cheapest_sizes(costs.curve)))
    costs.shapes = model.shapes
    return costs


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


def deep_depth(model: EngineTarget, n_max: int) -> int | None:
    """The second depth a few sizes are timed at, for what a row costs per context token (``row_depth_s``):
    ``DEEP_DEPTH``, or as deep as the context allows; None where that is too near the curve's own depth to tell."""
    deep = min(DEEP_DEPTH, model.capacity - max(DEEP_SIZES) - 1)
    return deep if deep - curve_depth(model, n_max) >= DEEP_MIN_GAP else None


def row_depth_s(shallow: dict[int, float], deep: dict[int, float], gap: int) -> float:
    """Seconds one row adds per context token: the least-squares slope through the origin of what each size
    gained between the two depths, against its rows times ``gap`` (never below 0: noise is not a discount).

    >>> round(row_depth_s({1: 0.010, 4: 0.014}, {1: 0.011, 4: 0.018}, 1000) * 1e6, 3)
    1.0
    """
    sizes = [n for n in deep if n in shallow]
    num = sum(n * (deep[n] - shallow[n]) for n in sizes)
    den = sum(n * n for n in sizes) * gap
    return max(0.0, num / den) if den > 0 else 0.0


def _measure_curve(model: EngineTarget, n_max: int, depth: int = 128, reps: int = 5, budget_s: float = 1.0,
                   tries: int = MEASURE_TRIES) -> tuple[list[float], float, str]:
    """``measure_curve`` and ``row_depth_s`` (a few sizes timed again ``deep_depth`` deep), timed again while the
    machine looks busy (``timing.steady_watched``: by the timings' spread or by other processes' CPU use); also
    returns why it stayed a busy machine's ("" where it did not)."""
    depth = curve_depth(model, n_max, depth)
    deep = deep_depth(model, n_max) if depth == curve_depth(model, n_max) else None
    # every size up to 24: kernels that take rows in groups make the curve saw-toothed (``cheapest_sizes``)
    sizes = [n for n in (*range(1, 25), 32, 48, 64) if n < n_max] + [n_max]
    toks = filler(model, max(depth + n_max, (deep or 0) + max(DEEP_SIZES)))

    def measure() -> dict:
        timed = time_calls(model, toks, sizes, depth, reps, budget_s=budget_s)
        if deep is not None:  # keyed apart: (depth, n)
            more = time_calls(model, toks, DEEP_SIZES, deep, reps, budget_s=budget_s / 2)
            timed.update({(deep, n): ts for n, ts in more.items()})
        return timed

    # the typical size judged, not the worst: of 20-odd sizes one is often disturbed even on a quiet machine,
    # and a size priced too dear is corrected online (``CostModel.observe_call``)
    # the cores watched too (``steady_watched``): load that delays every call alike passes the noise rule, and a
    # curve timed so (t(1) 79 ms where a quiet one is 20, on Gemma 3 270M) was cached and priced every later run
    timed = steady_watched(measure, tries, quantile=0.5, threads=model.n_threads)
    best = {n: min(ts, default=float("inf")) for n, ts in timed.samples.items()}
    shallow = {n: t for n, t in best.items() if isinstance(n, int)}
    slope = 0.0 if deep is None else row_depth_s(shallow, {n: best[(deep, n)] for n in DEEP_SIZES}, deep - depth)
    return _interpolate(shallow, n_max), slope, busy_reason(timed.noise, timed.busy, timed.load, model.n_threads)


# The second depth (``deep_depth``) and the sizes timed there: on the 1B stand-in at -t 2 one row took 22 ms at
# depth 128 and 44 ms at 900, where the curve alone priced rows at 128's cost wherever a generation was.
DEEP_DEPTH = 1024
DEEP_SIZES = (1, 4, 8)
DEEP_MIN_GAP = 256

_checked: set[tuple[Path, str]] = set()  # cached curves this process has checked (a bench builds many policies)


def _still_true(model: EngineTarget, cached: CostModel, tolerance: float = 5.0) -> bool:
    """Whether a cached curve still describes this machine: one-row calls timed now (a short context,
    the fastest of five) are within ``tolerance`` x of its t(1).

    A curve measured while other processes held the cores (llama.cpp's thread pool then stalls,
    here up to 3000x) would otherwise price every draft wrongly for as long as the cache lives.
    """
    depth = max(1, min(16, model.capacity - 2))
    now = min(time_calls(model, filler(model, depth + 1), [1], depth, reps=5)[1])
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


# -- bench's curve ------------------------------------------------------------------------------------


def bench_curve(
    model_path: str | Path,
    tokens: Sequence[int],
    *,
    n_max: int = 32,
    depth: int = 200,
    reps: int = 5,
    n_threads: int = 0,
    n_ctx: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """t(n) for n = 1..n_max after a ``depth``-token prefill, as ``bench`` reports it; ``tokens`` are cycled to
    fill both.  With ``progress``, a ``ui.Progress`` bar of the timed calls on stderr (the phase takes about a
    minute).

    Measured with the cost policy's own method (``time_calls``): a prefill of ``depth`` tokens, then each batch
    called and truncated back (only the call is timed), ``reps`` rounds with the n values interleaved so
    machine noise spreads over all of them.  Both the minimum and the median over the rounds are recorded;
    t(n) is the minimum (``cost_at``), the statistic ``measure_curve`` gives the cost policy: interference only
    ever adds time, so the fastest round is the closest to the cost itself.  The median is kept to show how
    noisy the machine was.

    The model is loaded with ``min_batch=1`` so t(1) is a true one-token batch.  Whether the run's plain steps
    cost t(1) or t(2) depends on its exact mode: exact shapes that pad one-token steps to two rows
    (``BatchShapes.min_rows``) make it t(2); ``--exact off`` (or auto's verdict off) runs them unpadded.  The
    report says which held in the run (``bench.report._cost_curve``).
    """
    if not tokens:
        raise ValueError("the cost curve needs some token ids to evaluate")
    model = LlamaModel(ModelConfig(Path(model_path), n_ctx=n_ctx, n_threads=n_threads, min_batch=1), role="target")
    try:
        depth = max(1, min(depth, model.capacity - n_max - 1))
        ids = [int(tokens[i % len(tokens)]) for i in range(depth + n_max)]
        sizes = range(1, n_max + 1)
        bar = Progress(f"bench: timing the verification cost curve t(n), n = 1..{n_max}", reps * n_max, "calls",
                       quiet=not progress)
        with bar:
            samples = time_calls(model, ids, sizes, depth, reps, warmup=(1, 2, n_max), progress=bar.update)
        threads = model.n_threads
    finally:
        model.close()
    return {
        "depth": depth,
        "reps": reps,
        "threads": threads,
        "min_batch": 1,
        "n": list(sizes),
        "median_s": [round(statistics.median(samples[n]), 7) for n in sizes],
        "min_s": [round(min(samples[n]), 7) for n in sizes],
        "note": "t(1) is a true 1-token batch (the run's own plain steps: see config.target.min_rows)",
    }


def cost_at(curve: dict[str, Any] | None, n: int) -> float | None:
    """t(n) from a ``bench_curve``, the fastest rep as the cost policy keeps it (None when n was not measured)."""
    if not curve:
        return None
    try:
        return curve["min_s"][curve["n"].index(n)]
    except (ValueError, IndexError, KeyError):
        return None
