"""Measuring a model never seen before beside its first generations, so that its first token is not late.

The exact call shapes (``costs.measure_shapes``), what exactness costs (``--exact auto``) and the cost
curve t(n) are measured once per model, thread count and machine, then cached.  Measured before the
first token, they cost seconds (on Gemma 3 270M at 2 threads: 4.2 s, six times llama.cpp's whole load
and first token).  Instead, where the cache lacks them, ``settle`` hands out provisional settings and
measures on a second llama.cpp context over the same weights (``LlamaModel.sibling``), in slices lent
between engine steps:

- Until the shapes are known, every call that commits tokens has one row (``PLAIN_ROWS``).  A one-row
  call *is* plain decoding, so speculation cannot change the output whatever the shapes turn out to be;
  the provisional cost model prices a k-token verification at k + 1 one-row calls, so the cost policy
  drafts (next to) nothing and no time is wasted on drafts that cannot pay.
- The two contexts never decode at once (``Gate``): llama.cpp's thread pool stalls when another takes
  a core, and the timings measured would be wrong.  The engine lends the measurement as much time as
  each step took, so tokens keep coming at half speed until it is done; idle time is lent whole.
- The result is adopted between steps (``adopt``).  Shapes whose one-token step is unpadded extend the
  one-row calls' output exactly, so they are adopted at once; shapes that pad it (``min_rows`` 2) would
  not, so they wait until no generation is running.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..llama import INEXACT, PLAIN_ROWS, BatchShapes
from .costs import DEEP_PROBE, CostModel, cached_shapes, calibrate, curve_cached, curve_key, ensure_shapes, exact_mode

if TYPE_CHECKING:
    from ..engine import Engine
    from ..llama import LlamaModel


class Abandoned(Exception):
    """The measurement was given up (the server stops): its thread ends at its next turn."""


class Gate:
    """Turns on the cores between the engine (which lends time) and a background measurement (which takes
    turns, one llama.cpp call or timed region at a time, only while time is lent).  Reentrant per thread,
    so a timed region can hold its turn across the calls it times."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._until = 0.0  # the background may start turns before this moment
        self._holder: int | None = None
        self._depth = 0
        self.closed = False  # the background is done: lending returns at once
        self.abandoned = False

    def __enter__(self) -> None:
        me = threading.get_ident()
        with self._cv:
            if self._holder == me:
                self._depth += 1
                return
            while time.perf_counter() >= self._until:
                if self.abandoned:
                    raise Abandoned()
                self._cv.wait()
            self._holder, self._depth = me, 1

    def __exit__(self, *exc: object) -> None:
        with self._cv:
            self._depth -= 1
            if self._depth == 0:
                self._holder = None
                self._cv.notify_all()

    def lend(self, seconds: float) -> None:
        """Let the background run for about ``seconds`` (a turn under way goes on to its end), then return."""
        with self._cv:
            if self.closed:
                return
            self._until = time.perf_counter() + seconds
            self._cv.notify_all()
            while not self.closed:
                left = self._until - time.perf_counter()
                if left <= 0 and self._holder is None:
                    break
                self._cv.wait(timeout=left if left > 0 and math.isfinite(left) else None)
            self._until = 0.0

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()

    def abandon(self) -> None:
        """No more turns: the next one raises ``Abandoned``.  Time still lent is taken back too, for a lender
        interrupted mid-``lend`` (Ctrl-C while finishing) leaves it lent, and the background would measure on."""
        with self._cv:
            self.abandoned = True
            self._until = 0.0
            self._cv.notify_all()


def probe_positions(target: "LlamaModel") -> int:
    """Positions per sequence the measuring context needs: the shape probe's deeper depth (``costs.probe_depths``)
    plus its largest call, rounded up to llama.cpp's 256-cell padding."""
    need = max(DEEP_PROBE, target.n_swa + 128) + 128 + 16
    return -(-need // 256) * 256


class BackgroundCalibration:
    """One model's missing measurements, run on a second context while the engine serves (see the module)."""

    def __init__(self, target: "LlamaModel", mode: str, n_max: int | None, shapes: BatchShapes | None) -> None:
        self.target, self.mode, self.n_max = target, mode, n_max
        self.known = shapes  # shapes already in the cache (only the curve is missing)
        self.gate = Gate()
        self.costs = CostModel([1.0] * curve_key(target, n_max)[0], shapes=PLAIN_ROWS, source="provisional") \
            if n_max is not None else None
        self.result: tuple[BatchShapes, CostModel | None] | None = None
        self.error: str | None = None
        self.adopted = False
        self.cached = False  # what was measured went to the disk cache (not where timings stayed noisy)
        self.started = time.perf_counter()
        self.spent = 0.0  # seconds lent
        self._thread = threading.Thread(target=self._work, name="specstack-calibration", daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return Path(str(self.target.path)).name

    @property
    def done(self) -> bool:
        return self.gate.closed

    def _work(self) -> None:
        probe = None
        try:
            with self.gate:  # allocating a context's buffers takes the cores too
                probe = self.target.sibling(probe_positions(self.target))
            probe.gate = self.gate
            if self.known is not None:
                probe.set_shapes(self.known)
            shapes = ensure_shapes(probe, self.mode, show_progress=False)
            costs = calibrate(probe, self.n_max, exact=self.mode) if self.n_max is not None else None
            self.result = (dataclasses.replace(shapes, pad_to=probe.shapes.pad_to), costs)  # pad_to: with the curve
            self.cached = cached_shapes(probe, self.mode) is not None and (
                self.n_max is None or curve_cached(probe, self.n_max))
        except Abandoned:
            pass
        except Exception as exc:  # the engine keeps the provisional (exact, unhurried) settings
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            if probe is not None:
                probe.close()
            self.gate.close()

    def lend(self, seconds: float) -> None:
        t0 = time.perf_counter()
        self.gate.lend(seconds)
        self.spent += time.perf_counter() - t0

    def adopt(self, engine: "Engine") -> bool:
        """Put the measured settings in force, if done and compatible with what is running (see the module).
        True once nothing is left to do (adopted, or failed: the provisional settings then stay)."""
        if not self.done:
            return False
        if self.result is None:
            if self.error is not None:
                _say(f"WARNING: measuring {self.name} failed ({self.error}); it keeps one-row calls (exact, no "
                     "speedup from speculation); run `specstack doctor` or report it")
            return True
        shapes, costs = self.result
        current = self.target.shapes
        changes_steps = shapes.exact and shapes.min_rows != current.min_rows
        if changes_steps and engine.running:
            return False
        if changes_steps:
            engine.forget_decoded()  # KV decoded with the other one-token step would not extend exactly
        self.target.set_shapes(shapes)
        if costs is not None and self.costs is not None:
            self.costs.adopt(dataclasses.replace(costs, shapes=self.target.shapes))
        self.adopted = True
        kept = "cached for later runs" if self.cached else "not cached, as the machine was busy: a later run measures again"
        _say(f"measured {self.name} in {time.perf_counter() - self.started:.1f} s ({self.spent:.1f} s of it lent by "
             f"the engine; {kept}); now {describe(self.target.shapes)}")
        return True

    def finish(self, engine: "Engine") -> None:
        """Run what is left to its end now (the engine is idle), then adopt it."""
        if not self.done:
            _say(f"finishing the one-time measurement of {self.name} (later runs find it cached and start at once)")
        engine.idle(math.inf)  # lends what is left, adopts, and lets the engine forget this measurement

    def abandon(self) -> None:
        """Give the measurement up and wait for its context to be freed (before the weights are)."""
        self.gate.abandon()
        self._thread.join(timeout=60)


def describe(shapes: BatchShapes) -> str:
    if shapes.pending:
        return "one-row calls (plain decoding) until the measurement ends"
    return f"exact mode {'on' if shapes.exact else 'off'} ({shapes.why})"


def _say(message: str) -> None:
    print(f"specstack: {message}", file=sys.stderr, flush=True)


def open_for_mode(target: "LlamaModel", exact: bool | str, measure: bool = False) -> "LlamaModel":
    """The target to run ``--exact`` with: under off (auto: once its verdict is off), a target of several
    slots is reopened on one unified KV cache with flash attention, its shapes settled.

    Separate KV streams keep every cell where a solo run puts it, which exactness needs, but llama.cpp runs
    a step over streams as one graph only when its sequences' ids run consecutively and each has the same
    rows (``BatchShapes.even_rows``); else it runs several, each a whole pass over the weights.  Four
    generations verifying 4 rows each took 232 ms in slots 0, 3, 5 and 8 against 141 ms in slots 0-3 (the
    1B stand-in, Q4_K_M, -t 2); on one unified cache with flash attention, 148 ms wherever they are, and
    uneven drafts need no padding.  Without exactness nothing needs the streams.  Auto decides on the
    streams: where its verdict is not cached yet, ``measure`` measures it now (the server, whose layout is
    fixed for its life: 8.9 s on the 1B stand-in with 10 slots at -t 2, once per model, thread count and
    slot count), else the streams are kept.
    """
    mode = exact_mode(exact)
    if mode == "on" or target.n_slots < 2 or target.unified or target.is_recurrent:
        return target
    shapes = cached_shapes(target, mode)
    if shapes is None and measure:
        _say(f"first run of {Path(str(target.path)).name} with {target.n_slots} slots at {target.n_threads} "
             f"thread{'' if target.n_threads == 1 else 's'}: measuring what exactness costs before serving, since "
             "it decides how the slots share the KV cache (cached for later runs)")
        shapes = ensure_shapes(target, mode)
    if shapes is None or shapes.exact:
        return target
    reopened = target.reopen(unified=True, flash_attn=True)
    reopened.set_shapes(dataclasses.replace(shapes, why=f"{shapes.why}; its {reopened.n_slots} slots share one "
                                                        "unified KV cache, with flash attention"))
    return reopened


def settle(target: "LlamaModel", exact: bool | str, n_max: int | None,
           background: bool = True) -> tuple[CostModel | None, BackgroundCalibration | None]:
    """Give ``target`` its shapes for ``--exact`` and, with ``n_max``, the cost curve the cost policy prices with.

    From the disk cache when it has them; else measured now or beside the engine (``BackgroundCalibration``,
    which the engine then drives).  Measured now: with ``background=False`` (a bench must compare settled
    shapes), and for ``--exact on``, which promises output identical to the measured shapes' own plain
    decoding from the first token: where those pad one-token steps, a first run's one-row calls could
    differ from later runs' at near-ties.  ``auto`` and ``off`` promise that only of the mode in force.
    Returns the cost model (provisional until adopted; None without ``n_max``) and the background work.
    """
    mode = exact_mode(exact)
    background = background and mode != "on"
    # settled already: reopened for its mode (``open_for_mode``), whose verdict was measured on another layout
    shapes = target.shapes if target.shapes.settled and not target.shapes.pending else cached_shapes(target, mode)
    if shapes is not None:
        target.set_shapes(shapes)
    if not background or (shapes is not None and (n_max is None or curve_cached(target, n_max))):
        ensure_shapes(target, mode)
        return (calibrate(target, n_max, exact=mode) if n_max is not None else None), None
    work = BackgroundCalibration(target, mode, n_max, target.shapes if shapes is not None else None)
    if shapes is None:
        target.set_shapes(INEXACT if mode == "off" else PLAIN_ROWS)
    what = "its cost curve" if shapes is not None else "its exact call shapes" + (" and cost curve" if n_max else "")
    _say(f"first run of {work.name} at {target.n_threads} thread{'' if target.n_threads == 1 else 's'}: measuring "
         f"{what} beside the first generations (cached for later runs); meanwhile {describe(target.shapes)}")
    return work.costs, work
