"""The target's verification cost curve: t(n) = seconds to evaluate n tokens in one batch.

Speculation pays off when t(k+1) is close to t(1): then k drafted tokens cost
little more than one plain step.  Measured with the cost policy's own method
(``costs.time_calls``): a prefill of ``depth`` tokens, then each batch called and
truncated back (only the call is timed), ``reps`` rounds with the n values
interleaved so machine noise spreads over all of them.  Both the minimum and the
median over the rounds are recorded; t(n) is the minimum (``cost_at``), the
statistic ``costs.measure_curve`` gives the cost policy: interference only ever
adds time, so the fastest round is the closest to the cost itself.  The median
is kept to show how noisy the machine was.

The model is loaded with ``min_batch=1`` so t(1) is a true one-token batch.
Whether the run's plain steps cost t(1) or t(2) depends on its exact mode: exact
shapes that pad one-token steps to two rows (``BatchShapes.min_rows``) make it
t(2); ``--exact off`` (or auto's verdict off) runs them unpadded.  The report says
which held in the run (``report._cost_curve``).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Sequence

from ..draft_length.costs import time_calls
from ..llama import LlamaModel, ModelConfig
from ..ui import Progress


def measure(
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
    """t(n) for n = 1..n_max after a ``depth``-token prefill; ``tokens`` are cycled to fill both.  With
    ``progress``, a ``ui.Progress`` bar of the timed calls on stderr (the phase takes about a minute)."""
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
    """t(n) from a measured curve, the fastest rep as the cost policy keeps it (None when n was not measured)."""
    if not curve:
        return None
    try:
        return curve["min_s"][curve["n"].index(n)]
    except (ValueError, IndexError, KeyError):
        return None
