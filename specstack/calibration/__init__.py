"""Calibration: what is measured per model, machine and thread count, cached on disk, and handed to the engine.

One entry point, ``calibrate_target`` (``load``), which ``loading`` calls once per loaded target and which
returns a ``Calibration``: the target opened for its ``--exact`` mode with its call shapes set, the cost
model the cost policy prices with, and the measurement left to run beside the engine, if any.  The engine
applies what calibration hands back; calibration never imports or calls the engine.

``modes`` (``--exact`` and what exactness costs), ``shapes`` (exact call shapes), ``timing`` (the one way
calls are timed, repeated while the machine is busy), ``curve`` (the cost curve t(n), and bench's),
``background`` (a first run's measurement beside the engine), ``cache`` (the on-disk cache), ``load`` (the
entry point).  The policy's ``CostModel`` itself lives in ``draft_length.costs``.
"""

from .background import BackgroundCalibration, Measured
from .curve import bench_curve, calibrate, cost_at
from .load import Calibration, calibrate_target, open_for_mode
from .modes import EXACT_MODES, exact_mode
from .shapes import cached_shapes, ensure_shapes, measure_shapes

__all__ = [
    "BackgroundCalibration", "Measured", "bench_curve", "calibrate", "cost_at", "Calibration", "calibrate_target",
    "open_for_mode", "EXACT_MODES", "exact_mode", "cached_shapes", "ensure_shapes", "measure_shapes",
]
