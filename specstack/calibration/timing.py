"""How calibration times llama.cpp calls: one method (``time_calls``), repeated while the machine is busy.

Every measured cost (the cost curve, what exactness costs, bench's t(n)) keeps the fastest of its
repetitions, as interference only ever adds time.  A timing taken while the machine was busy is measured
again (``steady``); if it stays noisy it is cached marked so (``timing_noise``, ``kept_entry``), used by later
starts while the machine stays busy and measured again at the first start that finds it quiet (``cached``).  What exactness costs
(``--exact auto``'s verdict) also watches the cores (``steady_watched``): other processes' CPU use counts as
busy by the same limit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import NamedTuple, Sequence, TypeVar

import numpy as np

from ..host.sysinfo import CpuLoad, CpuWatch
from ..llama import EngineTarget
from .cache import lookup, say_once

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
# Timings of one kind whose two fastest differ by more than this were disturbed by other work on the machine
# (quiet, they agree within a few percent: see ``timing_noise``), so the fastest may be too.
NOISE_LIMIT = 0.25
MEASURE_TRIES = 3  # a noisy timing is taken again up to this many times in all before it is used uncached


def filler(model: EngineTarget, n: int) -> list[int]:
    """Deterministic ordinary token ids (BOS first) for timing and shape probes."""
    first = model.bos_id if model.bos_id >= 0 else 0
    rng = np.random.default_rng(1234)  # varied ids: equal kernels on repetitive input can hide a difference
    return [first] + rng.integers(min(50, model.n_vocab - 1), model.n_vocab, n - 1).tolist()


def time_calls(model: EngineTarget, tokens: Sequence[int], sizes: Sequence[int], depth: int, reps: int, *,
               budget_s: float | None = None, warmup: Sequence[int] = (2,), min_reps: int = 2,
               progress: Callable[[int], None] | None = None) -> dict[int, list[float]]:
    """Seconds of one call of n rows after a ``depth``-token context, every round, for each n in ``sizes``.

    The one timing method of the cost curve (``curve.measure_curve`` and bench's ``curve.bench_curve``):
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


class Steady(NamedTuple):
    """Timings taken by ``steady``: the pooled ``samples``, their ``timing_noise``, and, where the cores were
    watched, ``busy``: the share of the measuring threads' cores that other processes held in the quietest try
    (``CpuLoad.contention``; 0 unwatched or unknown), with that try's ``load``."""

    samples: dict
    noise: float
    busy: float = 0.0
    load: CpuLoad | None = None


def steady(measure: Callable[[], dict[K, list[float]]], tries: int = MEASURE_TRIES,
           quantile: float = 1.0) -> tuple[dict[K, list[float]], float]:
    """Timings from ``measure``, taken again (their samples pooled) while their ``timing_noise`` at ``quantile``
    is above ``NOISE_LIMIT``, ``tries`` times at most; returns them and the noise left.

    Pooling, not replacing: a busy spell that ends mid-measurement leaves quiet timings in the pool, and the
    fastest two are what is judged.  Bounded, since a machine busy for good must still get a cost model.
    """
    timed = steady_watched(measure, tries, quantile)
    return timed.samples, timed.noise


def steady_watched(measure: Callable[[], dict[K, list[float]]], tries: int = MEASURE_TRIES, quantile: float = 1.0,
                   threads: int | None = None) -> Steady:
    """``steady``, and with ``threads`` the cores watched too: a try during which other processes held more than
    ``NOISE_LIMIT`` of the cores ``threads`` threads need is taken again as a noisy one is.

    Why both: timings on a machine that stays busy can agree with each other and still be wrong.  Load that
    delays every call alike passes the noise rule, yet the ratio of two kinds of call comes out wherever it
    falls: Gemma 3 270M's padded step measured +60% at one start-up and +3% in a bench on the same threads.
    The pool's fastest timings are the quietest try's (load only adds time), so that try's load is what the
    result is judged by.
    """
    samples: dict[K, list[float]] = {}
    busy, load = math.inf, None
    for _ in range(tries):
        watch = CpuWatch() if threads is not None else None
        more = measure()
        samples = {k: samples.get(k, []) + more.get(k, []) for k in more} if samples else more
        if watch is not None:
            seen = watch.read()
            share = 0.0 if seen is None else seen.contention(threads)  # type: ignore[arg-type]
            if share < busy:
                busy, load = share, seen
        if timing_noise(samples, quantile) <= NOISE_LIMIT and (watch is None or busy <= NOISE_LIMIT):
            break
    return Steady(samples, timing_noise(samples, quantile), 0.0 if math.isinf(busy) else busy, load)


def busy_reason(noise: float, busy: float = 0.0, load: CpuLoad | None = None, threads: int | None = None) -> str:
    """Why timings with this ``noise`` and ``busy`` share (``Steady``) are not a quiet machine's, in words; "" where
    they are."""
    reasons = []
    if noise > NOISE_LIMIT:
        shown = "an unbounded amount" if math.isinf(noise) else f"{100 * noise:.0f}%"
        reasons.append(f"repeated timings differed by {shown}")
    if busy > NOISE_LIMIT and load is not None:
        reasons.append(load.describe(threads))
    return "; ".join(reasons)


QUIET_CHECK_S = 0.3  # how long a start watches the cores before it measures a busy machine's entry again
_quiet: dict[tuple[int, int], bool] = {}  # (threads, minute) -> whether the cores were quiet then


def kept_entry(model: EngineTarget, what: str, entry: dict, noise: float, busy: str = "") -> dict:
    """``entry`` as cached: marked ``busy`` (why, in words) where the timings were a busy machine's (``noise``,
    ``busy``: ``busy_reason``), and said once.  Kept rather than dropped: a server started while the cores stay
    busy used to measure again at every start (ready in ~30 s on Gemma 3 270M, against 3.5 s from the cache),
    and ``cached`` measures it again at the first start that finds the machine quiet."""
    reason = busy or busy_reason(noise)
    if not reason:
        return entry
    say_once(f"noisy:{model.path}", f"the machine was busy while timing {what} of {Path(str(model.path)).name} "
             f"({reason} after {MEASURE_TRIES} tries); using them, and keeping them for starts while the machine "
             "stays busy: the first start on a quiet machine measures them again")
    return {**entry, "busy": reason}


def cached(cache: dict, key: str, parse: Callable[[object], T], path: Path, model: EngineTarget, what: str) -> T | None:
    """``cache.lookup``, where an entry a busy machine measured (``kept_entry``) stands only while the machine is
    busy: a start that finds the cores quiet gets None, so it measures again and caches a quiet machine's."""
    value = lookup(cache, key, parse, path)
    reason = cache[key].get("busy") if value is not None and isinstance(cache.get(key), dict) else None
    if not reason:
        return value
    name = Path(str(model.path)).name
    if quiet_now(model.n_threads):
        say_once(f"remeasure:{key}", f"{what} of {name} was measured on a busy machine ({reason}); the machine is "
                                     "quiet now, so measuring it again")
        return None
    say_once(f"kept:{key}", f"using {what} of {name} as measured at an earlier start on a busy machine ({reason}); "
                            "the machine is busy now too, so it is kept, and a start on a quiet machine measures it again")
    return value


def quiet_now(threads: int) -> bool:
    """Whether other processes leave the cores ``threads`` threads need free (``NOISE_LIMIT``), watched for
    ``QUIET_CHECK_S`` once a minute at most (one start looks several entries up)."""
    slot = (threads, int(time.monotonic() // 60))
    if slot not in _quiet:
        watch = CpuWatch()
        time.sleep(QUIET_CHECK_S)
        load = watch.read()
        _quiet[slot] = load is not None and load.contention(threads) <= NOISE_LIMIT
    return _quiet[slot]
