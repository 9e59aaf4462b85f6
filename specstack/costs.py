"""Measured costs: the target's verification curve t(n), calibrated at load and refined online.

t(n) is the time to evaluate a batch of n tokens at the current context
depth on this machine and thread count.  On 2 cores it grows steeply past
n ~ 4 (compute-bound), which is why k must be chosen from measurements.
Calibration takes well under a second on small models and is cached on disk
by model file (path, size, mtime), threads and llama.cpp build.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .paths import cache_dir

CURVE_VERSION = 2  # bump when the measurement method changes: old cache entries are ignored


@dataclass
class CostModel:
    """t(n) for n = 1..len(curve); beyond it, extrapolated linearly from the last two points.

    Online refinement: sizes seen often enough use their own running
    estimate; the others are the calibrated curve times a running scale
    factor (observed / calibrated over all steps), so a calibration made on
    a busy machine, or a change in load, corrects sizes not tried yet.
    """

    curve: list[float]
    ema: float = 0.1  # weight of one online observation
    source: str = "calibrated"
    min_seen: int = 3
    _online: dict[int, float] = field(default_factory=dict)
    _seen: dict[int, int] = field(default_factory=dict)
    _scale: float = 1.0

    def verify_s(self, n: int) -> float:
        n = max(n, 1)
        if self._seen.get(n, 0) > self.min_seen:
            return max(self._online[n], self._floor(n))
        return self._calibrated(n) * self._scale

    def _floor(self, n: int) -> float:
        """Keep t non-decreasing: no size may look cheaper than a smaller one known online."""
        known = [self._online[m] for m in self._online if m < n and self._seen[m] > self.min_seen]
        return max(known, default=0.0)

    def _calibrated(self, n: int) -> float:
        c = self.curve
        if n <= len(c):
            return c[n - 1]
        slope = max(c[-1] - c[-2], 0.0) if len(c) > 1 else c[-1]
        return c[-1] + slope * (n - len(c))

    def observe_verify(self, n: int, seconds: float) -> None:
        """Refine from a real step (seconds <= 0 means not measured)."""
        if n < 1 or seconds <= 0:
            return
        # One step can be delayed by far more than its cost (a cold first call, the OS
        # scheduling another process): clip so that no single step dominates.
        seconds = min(seconds, 3.0 * self.verify_s(n))
        self._seen[n] = self._seen.get(n, 0) + 1
        if self._seen[n] == 1:
            return  # the first batch of a new shape pays one-off graph and buffer setup
        prev = self._online.get(n)
        self._online[n] = seconds if prev is None else prev + self.ema * (seconds - prev)
        self._scale += self.ema * (seconds / self._calibrated(n) - self._scale)


def measure_curve(model, n_max: int, depth: int = 128, reps: int = 5, budget_s: float = 3.0) -> list[float]:
    """Time of evaluating n tokens after ``depth`` context tokens, n = 1..n_max.

    Uses the model's own eval path (including the one-token padding of a
    batch-invariant target), then truncates back.  Rounds sweep all n in turn
    and each n keeps its *minimum*: on a shared machine interference only
    ever adds time, so the minimum is the most faithful estimate.  Stops
    after ``budget_s`` once every n has at least one sample.
    """
    depth = max(1, min(depth, model.capacity - n_max - 1))
    filler = [model.bos_id if model.bos_id >= 0 else 0] + [min(100 + i, model.n_vocab - 1) for i in range(depth + n_max)]
    model.reset()
    model.eval(filler[:depth], logits_from=depth)
    model.eval(filler[depth : depth + 2], logits_from=0)  # warm-up
    model.truncate(depth)
    sizes = [n for n in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64) if n < n_max] + [n_max]
    best = {n: float("inf") for n in sizes}
    start = time.perf_counter()
    for _ in range(reps):
        for n in sizes:
            t0 = time.perf_counter()
            model.eval(filler[depth : depth + n], logits_from=0)
            best[n] = min(best[n], time.perf_counter() - t0)
            model.truncate(depth)
        if time.perf_counter() - start > budget_s:
            break
    model.reset()
    return _interpolate(best, n_max)


def _interpolate(points: dict[int, float], n_max: int) -> list[float]:
    """t(1..n_max) from measured sizes: linear between them, then made non-decreasing."""
    xs = sorted(points)
    curve = []
    for n in range(1, n_max + 1):
        hi = next(x for x in xs if x >= n)
        lo = max((x for x in xs if x <= n), default=hi)
        t = points[lo] if hi == lo else points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo)
        curve.append(t)
    for i in range(1, n_max):  # a bigger batch never costs less
        curve[i] = max(curve[i], curve[i - 1])
    return curve


def _cache_key(model, n_max: int) -> str:
    from .target import system_info

    st = os.stat(model.path)
    config = {k: v for k, v in vars(model.config).items() if k != "path"}
    raw = json.dumps([CURVE_VERSION, str(Path(model.path).resolve()), st.st_size, int(st.st_mtime), model.n_threads,
                      repr(config), n_max, system_info()])
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def calibrate(model, n_max: int = 17, use_cache: bool = True) -> CostModel:
    """t(n) for this model, machine and thread count: from the disk cache or measured now."""
    path = cache_dir() / "costs.json"
    key = _cache_key(model, n_max)
    cache: dict = {}
    if use_cache and path.exists():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
        if key in cache:
            return CostModel(list(cache[key]["curve_s"]), source="cache")
    curve = measure_curve(model, n_max)
    if use_cache:
        cache[key] = {"model": str(model.path), "threads": model.n_threads, "curve_s": curve, "measured": time.time()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache))
            tmp.replace(path)
        except OSError:
            pass  # a read-only cache dir only costs a re-measurement
    return CostModel(curve)
