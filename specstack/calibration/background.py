"""Measuring a model never seen before beside its first generations, so that its first token is not late.

The exact call shapes (``shapes.measure_shapes``), what exactness costs (``--exact auto``, ``modes``) and
the cost curve t(n) (``curve``) are measured once per model, thread count and machine, then cached.
Measured before the first token, they cost seconds (on Gemma 3 270M at 2 threads: 4.2 s, six times
llama.cpp's whole load and first token).  Instead, where the cache lacks them, ``calibrate_target`` hands out provisional settings
and measures on a second llama.cpp context over the same weights (``LlamaModel.sibling``), in slices lent
between engine steps:

- Until the shapes are known, every call that commits tokens has one row (``PLAIN_ROWS``).  A one-row
  call *is* plain decoding, so speculation cannot change the output whatever the shapes turn out to be;
  the provisional cost model prices a k-token verification at k + 1 one-row calls, so the cost policy
  drafts (next to) nothing and no time is wasted on drafts that cannot pay.
- The two contexts never decode at once (``Gate``): llama.cpp's thread pool stalls when another takes
  a core, and the timings measured would be wrong.  The engine lends the measurement as much time as
  each step took, so tokens keep coming at half speed until it is done; idle time is lent whole.
- The engine pulls the finished result between steps (``result``) and puts it in force itself
  (``Engine.idle``); nothing here calls the engine.  Shapes whose one-token step is unpadded extend the
  one-row calls' output exactly, so they are applied at once; shapes that pad it (``min_rows`` 2) would
  not, so they wait until no generation is running.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..draft_length.costs import CostModel
from ..llama import PLAIN_ROWS, BatchShapes
from .cache import say
from .curve import calibrate, curve_cached, curve_key
from .shapes import DEEP_PROBE, cached_shapes, ensure_shapes

if TYPE_CHECKING:
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
    """Positions per sequence the measuring context needs: the shape probe's deeper depth (``shapes.probe_depths``)
    plus its largest call, rounded up to llama.cpp's 256-cell padding."""
    need = max(DEEP_PROBE, target.n_swa + 128) + 128 + 16
    return -(-need // 256) * 256


@dataclass(frozen=True)
class Measured:
    """A finished background measurement, for the engine to put in force (``Engine.idle``).

    ``shapes`` None: it failed or was given up, and the provisional settings stay.  ``costs`` is the measured
    curve (None where none was asked for); ``provisional`` the cost model handed out at load, which the
    policies share: it adopts ``costs`` (``CostModel.adopt``).
    """

    shapes: BatchShapes | None
    costs: CostModel | None = None
    provisional: CostModel | None = None


class BackgroundCalibration:
    """One model's missing measurements, run on a second context while the engine serves (see the module)."""

    def __init__(self, target: "LlamaModel", mode: str, n_max: int | None, shapes: BatchShapes | None) -> None:
        self.target, self.mode, self.n_max = target, mode, n_max
        self.known = shapes  # shapes already in the cache (only the curve is missing)
        self.gate = Gate()
        self.costs = CostModel([1.0] * curve_key(target, n_max)[0], shapes=PLAIN_ROWS, source="provisional") \
            if n_max is not None else None
        self._measured: tuple[BatchShapes, CostModel | None] | None = None
        self.error: str | None = None
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
            self._measured = (dataclasses.replace(shapes, pad_to=probe.shapes.pad_to), costs)  # pad_to: with the curve
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

    def result(self) -> Measured | None:
        """What was measured, once done (None while it runs); its ``shapes`` are None where it failed or was
        given up.  The engine puts it in force (see the module) and then calls ``report``."""
        if not self.done:
            return None
        if self._measured is None:
            return Measured(None)
        shapes, costs = self._measured
        return Measured(shapes, costs, self.costs)

    def report(self, now: BatchShapes) -> None:
        """Say what came of the measurement, once the engine has put it in force (``now``: the target's shapes)."""
        if self._measured is None:
            if self.error is not None:
                say(f"WARNING: measuring {self.name} failed ({self.error}); it keeps one-row calls (exact, no "
                     "speedup from speculation); run `specstack doctor` or report it")
            return
        kept = ("cached for later runs" if self.cached else "cached marked as a busy machine's: a later start on a quiet "
                "machine measures again")
        say(f"measured {self.name} in {time.perf_counter() - self.started:.1f} s ({self.spent:.1f} s of it lent by "
             f"the engine; {kept}); now {describe(now)}")

    def say_finishing(self) -> None:
        """Before the engine lends what is left whole (``Engine.finish_calibration``): say why the run waits."""
        if not self.done:
            say(f"finishing the one-time measurement of {self.name} (later runs find it cached and start at once)")

    def abandon(self) -> None:
        """Give the measurement up and wait for its context to be freed (before the weights are)."""
        self.gate.abandon()
        self._thread.join(timeout=60)


def describe(shapes: BatchShapes) -> str:
    if shapes.pending:
        return "one-row calls (plain decoding) until the measurement ends"
    return f"exact mode {'on' if shapes.exact else 'off'} ({shapes.why})"
