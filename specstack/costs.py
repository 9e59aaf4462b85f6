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


@dataclass
class CostModel:
    """t(n) for n = 1..len(curve); beyond it, extrapolated linearly from the last two points."""

    curve: list[float]
    ema: float = 0.1  # weight of one online observation
    source: str = "calibrated"
    _observed: dict[int, int] = field(default_factory=dict)

    def verify_s(self, n: int) -> float:
        c = self.curve
        if n <= len(c):
            return c[max(n, 1) - 1]
        slope = max(c[-1] - c[-2], 0.0) if len(c) > 1 else c[-1]
        return c[-1] + slope * (n - len(c))

    def observe_verify(self, n: int, seconds: float) -> None:
        """Refine t(n) from a real step, keeping the curve non-decreasing."""
        if not 1 <= n <= len(self.curve) or seconds <= 0:
            return
        i = n - 1
        self.curve[i] += self.ema * (seconds - self.curve[i])
        self._observed[n] = self._observed.get(n, 0) + 1
        for j in range(i + 1, len(self.curve)):
            if self.curve[j] < self.curve[j - 1]:
                self.curve[j] = self.curve[j - 1]
        for j in range(i - 1, -1, -1):
            if self.curve[j] > self.curve[j + 1]:
                self.curve[j] = self.curve[j + 1]

    def to_dict(self) -> dict:
        return {"curve_s": [round(x, 7) for x in self.curve], "source": self.source}


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
    best = [float("inf")] * n_max
    start = time.perf_counter()
    for _ in range(reps):
        for n in range(1, n_max + 1):
            t0 = time.perf_counter()
            model.eval(filler[depth : depth + n], logits_from=0)
            best[n - 1] = min(best[n - 1], time.perf_counter() - t0)
            model.truncate(depth)
        if time.perf_counter() - start > budget_s:
            break
    model.reset()
    for i in range(1, n_max):  # monotone: a bigger batch never costs less
        best[i] = max(best[i], best[i - 1])
    return best


def _cache_key(model, n_max: int) -> str:
    from .target import system_info

    st = os.stat(model.path)
    raw = json.dumps([str(Path(model.path).resolve()), st.st_size, int(st.st_mtime), model.n_threads,
                      model.min_batch, n_max, system_info()])
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
