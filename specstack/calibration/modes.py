"""``--exact``: its modes, and what exact call shapes cost, which decides ``auto``.

``on`` keeps every target call in the shapes measured to compute exactly as plain decoding (``shapes``);
``off`` never pads or splits; ``auto`` keeps the exact shapes only where ``measure_exact_cost`` finds them
within ``AUTO_EXACT_LIMIT`` of the calls they replace (``auto_verdict``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..errors import InvalidParameterError
from ..llama import INEXACT, BatchShapes, EngineTarget
from .cache import entry_key, need_dict, need_int, need_seconds
from .timing import MEASURE_TRIES, busy_reason, filler, steady_watched

EXACT_MODES = ("auto", "on", "off")
# --exact auto keeps exact calls where they cost at most this share of the calls they replace.  Below
# it the price of bit-identity is within this machine's run-to-run noise; above it (a pad row that
# costs most of a step, as on Gemma 3 at 1-2 threads, or verification split into many calls) the
# speed is worth more to most users than identity at near-ties, which no peer offers either.
AUTO_EXACT_LIMIT = 0.03


def exact_mode(exact: bool | str) -> str:
    """``--exact`` as one of ``EXACT_MODES`` (True/False, as in older roles files, mean on/off)."""
    mode = ("on" if exact else "off") if isinstance(exact, bool) else exact
    if mode not in EXACT_MODES:
        raise InvalidParameterError(f"exact must be one of {', '.join(EXACT_MODES)} (got {exact!r})")
    return mode


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
    busy: str = field(default="", compare=False)  # why the machine counted as busy (``timing.busy_reason``), or ""

    @classmethod
    def parse(cls, entry: object) -> "ExactCost":
        """A cached verdict, checked (``cache``): shares >= 0 and a row count, else ValueError."""
        d = need_dict(entry, ("pad", "split", "rows"))
        return cls(pad=need_seconds(d["pad"], "pad", positive=False), split=need_seconds(d["split"], "split", positive=False),
                   rows=need_int(d["rows"], "rows", 2), busy=str(d.get("busy") or ""))

    def entry(self) -> dict:
        """The verdict as cached (``timing.kept_entry`` adds why the machine was busy, where it was)."""
        return {"pad": self.pad, "split": self.split, "rows": self.rows}

    @property
    def worst(self) -> float:
        return max(self.pad, self.split)

    def describe(self) -> str:
        return (f"a padded one-token step costs {100 * self.pad:+.0f}%, a {self.rows}-row verification split "
                f"into exact calls {100 * self.split:+.0f}%")


def is_free(model: EngineTarget, shapes: BatchShapes) -> bool:
    """Exact shapes that constrain nothing: no pad, no split."""
    return shapes.min_rows == 1 and shapes.max_rows >= model.batch_cap


def auto_verdict(model: EngineTarget, shapes: BatchShapes, cost: ExactCost | None) -> BatchShapes:
    """``--exact auto``: the measured exact ``shapes`` if they cost little here (``cost``; None: free), else none."""
    if cost is None:
        return dataclasses.replace(shapes, why="--exact auto: on, every call shape is exact on this model (free)")
    where = f"{Path(str(model.path)).name} at {model.n_threads} thread{'' if model.n_threads == 1 else 's'}"
    if cost.worst <= AUTO_EXACT_LIMIT:
        why = f"--exact auto: on, exactness costs little on {where} ({cost.describe()})"
        return dataclasses.replace(shapes, why=why + _busy_note(cost))
    why = (f"--exact auto: off, exactness would cost too much on {where} ({cost.describe()}; the limit is "
           f"{100 * AUTO_EXACT_LIMIT:.0f}%); greedy output may differ from plain decoding at near-ties; --exact on "
           "keeps it identical")
    return dataclasses.replace(INEXACT, why=why + _busy_note(cost))


def _busy_note(cost: ExactCost) -> str:
    """What a verdict measured on a busy machine adds to its ``why``: that it was, and until when it holds.  The
    costs it compares shift with the load (+60% at one start, +3% at the next, on one model), so such a verdict
    is not the machine's: it is kept for starts while the machine stays busy, and the first start on a quiet
    machine measures it again (``timing.cached``)."""
    if not cost.busy:
        return ""
    return (f"; measured while the machine was busy ({cost.busy}), so kept only until a start on a quiet machine "
            "measures it again")


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
    busy, by the timings' spread or by other processes' CPU use (``timing.steady_watched``); ``ExactCost.noise``
    says how noisy the timings stayed, ``ExactCost.busy`` why the verdict is a busy machine's, if it is.
    """
    rows, depth = _exact_cost_plan(model, depth, rows)
    timed = steady_watched(lambda: _time_exact_kinds(model, shapes, depth, rows, reps, budget_s), tries,
                           threads=model.n_threads)
    best = {k: min(v) for k, v in timed.samples.items()}
    split = rows > shapes.max_rows  # verification of ``rows`` rows is cut into several calls
    return ExactCost(pad=max(0.0, best["padded"] / best["plain"] - 1),
                     split=max(0.0, best["split"] / best["whole"] - 1) if split else 0.0, rows=rows,
                     noise=timed.noise, busy=busy_reason(timed.noise, timed.busy, timed.load, model.n_threads))


def _time_exact_kinds(model: EngineTarget, shapes: BatchShapes, depth: int, rows: int, reps: int,
                      budget_s: float) -> dict[str, list[float]]:
    """Seconds of each kind of call ``measure_exact_cost`` compares, every round (two rounds at least)."""
    toks = filler(model, depth + rows)
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
