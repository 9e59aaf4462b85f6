"""Calibration's one entry point: ``calibrate_target``, which the loader calls once per loaded target.

It opens the target for its ``--exact`` mode (``open_for_mode``: a multi-slot target under off is reopened
on one unified KV cache; one whose slots share a KV pool, -kvu, runs without exactness), gives it its call shapes (``shapes``) and, where a cost curve is asked for, the
``CostModel`` the cost policy prices with (``curve``): from the disk cache (``cache``), measured now, or
measured beside the first generations (``background``).  What it hands back (``Calibration``) the engine
applies; nothing here calls the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..draft_length.costs import CostModel
from ..errors import InvalidParameterError
from ..llama import INEXACT, PLAIN_ROWS, BatchShapes
from .background import BackgroundCalibration, describe
from .cache import say
from .curve import calibrate, curve_cached
from .modes import exact_mode
from .shapes import cached_shapes, ensure_shapes

if TYPE_CHECKING:
    from ..llama import LlamaModel


@dataclass
class Calibration:
    """What calibration hands a loaded target's users.

    ``target``: the target opened for its ``--exact`` mode (it may have been reopened: use this one), its call
    shapes set (``shapes``; provisional while ``background`` measures, when ``shapes.pending``).  ``costs``: the
    cost model the cost policy prices with, None where no curve was asked for; the policies share it, and it
    adopts the measured curve when the engine applies the background's result.  ``background``: the
    measurement running beside the engine, None where nothing is left to measure; hand it to the ``Engine``,
    which lends it time and applies its result.
    """

    target: "LlamaModel"
    costs: CostModel | None = None
    background: BackgroundCalibration | None = None

    @property
    def shapes(self) -> BatchShapes:
        return self.target.shapes


def calibrate_target(target: "LlamaModel", exact: bool | str = "auto", *, n_max: int | None = None,
                     background: bool = False, measure: bool = False,
                     opened: Callable[["LlamaModel"], None] | None = None) -> Calibration:
    """Calibrate a freshly loaded ``target`` for ``--exact`` (``modes.EXACT_MODES``): the one entry point.

    ``measure``: where auto's verdict is not cached, measure it now, since it fixes how a multi-slot target's
    slots share the KV cache (a server; ``open_for_mode``).  ``opened`` is called with the target once it is
    open for its mode, before anything is measured on it (the loader announces it).  ``n_max``: the rows of the
    cost curve to calibrate (None: no cost model).  ``background``: measure what the cache lacks beside the
    first generations (``BackgroundCalibration``) rather than now (see ``_settle``).
    """
    target = open_for_mode(target, exact, measure=measure)
    if opened is not None:
        opened(target)
    costs, work = _settle(target, "off" if target.pool is not None else exact, n_max, background=background)
    return Calibration(target, costs, work)


def open_for_mode(target: "LlamaModel", exact: bool | str, measure: bool = False) -> "LlamaModel":
    """The target to run ``--exact`` with: under off (auto: once its verdict is off), a target of several
    slots is reopened on one unified KV cache with flash attention, and a one-slot target whose flash
    attention is auto (``ModelConfig.flash_attn`` None) with flash attention; either way its shapes settled.

    Separate KV streams keep every cell where a solo run puts it, which exactness needs, but llama.cpp runs
    a step over streams as one graph only when its sequences' ids run consecutively and each has the same
    rows (``BatchShapes.even_rows``); else it runs several, each a whole pass over the weights.  Four
    generations verifying 4 rows each took 232 ms in slots 0, 3, 5 and 8 against 141 ms in slots 0-3 (the
    1B stand-in, Q4_K_M, -t 2); on one unified cache with flash attention, 148 ms wherever they are, and
    uneven drafts need no padding.  Without exactness nothing needs the streams.  Flash attention alone is
    worth 4-5% of a plain step on Gemma 3 270M at -t 1 (as llama.cpp's -fa auto); a new context on the
    loaded weights costs about 40 ms there.  Auto decides: where its verdict is not cached yet, ``measure``
    measures it now (the server, whose layout is fixed for its life: 8.9 s on the 1B stand-in with 10
    slots at -t 2, once per model, thread count and slot count), else the target is kept as it is.
    """
    mode = exact_mode(exact)
    if target.pool is not None:
        return _pooled(target, mode)
    several = target.n_slots >= 2 and not target.unified
    flash = target.config.flash_attn is None and not target.flash_attn  # auto: on where exactness is off
    if mode == "on" or target.is_recurrent or not (several or flash):
        return target
    shapes = cached_shapes(target, mode)
    if shapes is None and measure and several:
        say(f"first run of {Path(str(target.path)).name} with {target.n_slots} slots at {target.n_threads} "
             f"thread{'' if target.n_threads == 1 else 's'}: measuring what exactness costs before serving, since "
             "it decides how the slots share the KV cache (cached for later runs)")
        shapes = ensure_shapes(target, mode)
    if shapes is None or shapes.exact:
        return target
    fa = target.config.flash_attn is not False
    reopened = target.reopen(unified=True, flash_attn=fa) if several else target.reopen(flash_attn=True)
    layout = f"its {reopened.n_slots} slots share one unified KV cache" if several else "its one slot"
    reopened.set_shapes(dataclasses.replace(shapes, why=f"{shapes.why}; {layout}, with"
                                                        f"{'' if fa else 'out'} flash attention"))
    return reopened


def _pooled(target: "LlamaModel", mode: str) -> "LlamaModel":
    """A target whose slots share one KV pool (-kvu) runs without exactness, whatever ``--exact`` asked (on is
    refused before the load, ``loading.TargetSpec``): in one unified cache the slots' cells interleave, which
    changed logits against a solo run by ~3e-3 here (``ModelConfig.n_slots``), and the shape probe, which runs one
    sequence, cannot see that.  Its shapes say so, and so /health, every response and ``generate``'s table do."""
    if mode == "on":
        raise InvalidParameterError(f"--exact on cannot go with {target.n_slots} slots sharing one KV pool (-kvu); "
                                    "use --exact off or auto, or leave -kvu out")
    asked = "off" if mode == "off" else f"{mode}: off"
    target.set_shapes(dataclasses.replace(INEXACT, why=f"--exact {asked}, as the {target.n_slots} slots share one "
                                                       f"KV pool of {target.pool} cells (-kvu): their cells interleave, so "
                                                       "a slot's output may differ from a solo run's at near-ties"))
    return target


def _settle(target: "LlamaModel", exact: bool | str, n_max: int | None,
           background: bool = True) -> tuple[CostModel | None, BackgroundCalibration | None]:
    """Give ``target`` its shapes for ``--exact`` and, with ``n_max``, the cost curve the cost policy prices with.

    From the disk cache when it has them; else measured now or beside the engine (``BackgroundCalibration``,
    which the engine then drives and applies).  Measured now: with ``background=False`` (a bench must compare settled
    shapes), and for ``--exact on``, which promises output identical to the measured shapes' own plain
    decoding from the first token: where those pad one-token steps, a first run's one-row calls could
    differ from later runs' at near-ties.  ``auto`` and ``off`` promise that only of the mode in force.
    Returns the cost model (provisional until the engine applies the background's result; None without
    ``n_max``) and the background work.
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
    say(f"first run of {work.name} at {target.n_threads} thread{'' if target.n_threads == 1 else 's'}: measuring "
         f"{what} beside the first generations (cached for later runs); meanwhile {describe(target.shapes)}")
    return work.costs, work
