"""The target's verification cost curve: t(n) = seconds to evaluate n tokens in one batch.

Speculation pays off when t(k+1) is close to t(1): then k drafted tokens cost
little more than one plain step.  Measured at a fixed context depth (a prefill
of ``depth`` tokens), each batch evaluated and truncated back, median of
``reps`` repetitions, with the n values interleaved within each repetition so
machine noise spreads over all of them.

The model is loaded with ``min_batch=1`` so t(1) is a true one-token batch.
specstack's engine never runs one: it pads one-token steps to two tokens for
batch-invariant logits (see README), so a plain decoding step costs t(2).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from ..target import LlamaModel, ModelConfig


def measure(
    model_path: str | Path,
    tokens: Sequence[int],
    *,
    n_max: int = 32,
    depth: int = 200,
    reps: int = 5,
    n_threads: int = 0,
    n_ctx: int = 0,
) -> dict[str, Any]:
    """t(n) for n = 1..n_max after a ``depth``-token prefill; ``tokens`` are cycled to fill both."""
    if not tokens:
        raise ValueError("the cost curve needs some token ids to evaluate")
    model = LlamaModel(ModelConfig(Path(model_path), n_ctx=n_ctx, n_threads=n_threads, min_batch=1), role="target")
    try:
        depth = max(1, min(depth, model.n_ctx - n_max - 1))
        need = depth + n_max
        ids = [int(tokens[i % len(tokens)]) for i in range(need)]
        model.reset()
        model.eval(ids[:depth], logits_from=depth)  # prefill, no logits
        samples: dict[int, list[float]] = {n: [] for n in range(1, n_max + 1)}
        batch = lambda n: ids[depth : depth + n]  # noqa: E731  the n tokens after the prefill
        for n in (1, 2, n_max):  # warm-up: first calls allocate compute buffers
            model.eval(batch(n), logits_from=0)
            model.truncate(depth)
        for _ in range(reps):
            for n in range(1, n_max + 1):
                t0 = time.perf_counter()
                model.eval(batch(n), logits_from=0)  # logits for every row, as verification needs
                samples[n].append(time.perf_counter() - t0)
                model.truncate(depth)
        threads = model.n_threads
    finally:
        model.close()
    med = [statistics.median(samples[n]) for n in range(1, n_max + 1)]
    return {
        "depth": depth,
        "reps": reps,
        "threads": threads,
        "min_batch": 1,
        "n": list(range(1, n_max + 1)),
        "median_s": [round(x, 7) for x in med],
        "min_s": [round(min(samples[n]), 7) for n in range(1, n_max + 1)],
        "note": "t(1) is a true 1-token batch; specstack pads 1-token steps to 2, so a plain step costs t(2)",
    }


def cost_at(curve: dict[str, Any] | None, n: int) -> float | None:
    """t(n) from a measured curve (None when n was not measured)."""
    if not curve:
        return None
    try:
        return curve["median_s"][curve["n"].index(n)]
    except (ValueError, IndexError, KeyError):
        return None
