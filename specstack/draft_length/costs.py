"""The cost policy's cost model: t(n) for one target call of n rows, priced through the target's call plan.

``CostModel`` holds a measured curve (``calibration.curve.calibrate`` measures it at load, or reads it from the
disk cache) and refines it online from the steps the engine observes.  Measuring lives in ``calibration``;
this module only prices.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

from ..llama import BatchShapes, plan_calls


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

    Depth: every row of a call attends over its sequence's whole context, so a row costs more the deeper the
    generation is, and a ratio of sizes measured at one depth underprices rows deeper in (the 1B stand-in at -t 2:
    one row 22 ms at depth 128, 44 ms at 900).  The curve is timed at ``depth0``; ``row_depth_s`` is what one row
    adds per context token beyond it (``calibration.curve`` times a second depth; 0 where it was not measured), so
    t(n, d) = t(n) + n * row_depth_s * (d - depth0).  Online estimates are kept at ``depth0``: what a step
    observed at its depth is moved there first.
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
    depth0: int = 0  # the context depth the curve was timed at
    row_depth_s: float = 0.0  # seconds one row adds per context token past depth0

    def __post_init__(self) -> None:
        self._dearest = list(itertools.accumulate(self.curve, max))

    def adopt(self, measured: "CostModel") -> None:
        """Price with ``measured`` from now on: a calibration that finished after this object was handed to
        policies (``calibration.background``), which all share it.  What was learnt online was learnt against the
        provisional curve, so it goes too."""
        self.curve, self.shapes, self.source = list(measured.curve), measured.shapes, measured.source
        self.depth0, self.row_depth_s = measured.depth0, measured.row_depth_s
        self._dearest = list(measured._dearest)
        self._online, self._seen, self._scale = {}, {}, 1.0

    def call_s(self, rows: int) -> float:
        """One call of ``rows`` rows (padded to min_rows, or to a cheaper size: ``BatchShapes.pad_to``)."""
        n = self.shapes.rows_for(max(rows, 1))
        if self._seen.get(n, 0) > self.min_seen:
            return max(self._online[n], self._floor(n))
        return self._calibrated(n) * self._scale

    def batch_s(self, rows: Sequence[int], depths: Sequence[int | None] = ()) -> float:
        """A step in which generation i evaluates ``rows[i]`` rows (its pending token plus its draft) after
        ``depths[i]`` context tokens (missing or None: at the curve's own depth)."""
        return (self._calls_s(rows) + self.rewind_s * sum(1 for r in rows if r > 1)
                + self._depth_s(rows, depths))

    def _depth_s(self, rows: Sequence[int], depths: Sequence[int | None]) -> float:
        """What the generations' rows cost beyond the curve for attending over contexts other than ``depth0``."""
        if not self.row_depth_s:
            return 0.0
        extra = sum(self.shapes.rows_for(max(r, 1)) * (d - self.depth0) for r, d in zip(rows, depths) if d is not None)
        return self.row_depth_s * extra

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

    def observe_step(self, rows: Sequence[int], seconds: float, depths: Sequence[int | None] = ()) -> None:
        """Refine from a real step's calls (seconds <= 0 means not measured; rewind time is not included), the
        generations ``depths`` deep (as ``batch_s``): kept as if timed at ``depth0``."""
        if not rows or seconds <= 0:
            return
        seconds = max(seconds - self._depth_s(rows, depths), 0.25 * seconds)
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
