"""llama-server's per-request telemetry: ``timings`` (``result_timings``: prompt and generation counts, times and
rates, drafts) and ``prompt_progress`` (``result_prompt_progress``), from a finished choice's stats or, while it
streams, from its generation's live counters (``timings_per_token``, ``return_progress``)."""

from __future__ import annotations

import time
from typing import Any

from .events import Done, Progress


def timings(prompt_n: int, cached: int, prefill_ms: float, predicted: int, predicted_ms: float, drafted: int,
            accepted: int) -> dict[str, Any]:
    """llama-server's ``timings`` object (the prompt's reused tokens counted apart, as its ``cache_n``)."""
    return {"cache_n": cached, "prompt_n": prompt_n - cached, "prompt_ms": prefill_ms,
            "prompt_per_token_ms": prefill_ms / max(1, prompt_n - cached),
            "prompt_per_second": (prompt_n - cached) / (prefill_ms / 1000) if prefill_ms else 0.0,
            "predicted_n": predicted, "predicted_ms": predicted_ms, **generation_rate(predicted, predicted_ms),
            "draft_n": drafted, "draft_n_accepted": accepted}


def generation_rate(n: int, ms: float) -> dict[str, float]:
    """llama-server's generation rate: over the decode steps, the first token excluded (it comes from the prompt's
    last batch and costs no step), so one token has no rate (0, as llama-server reports it)."""
    steps = max(0, n - 1)
    if not steps or ms <= 0:
        return {"predicted_per_token_ms": 0.0, "predicted_per_second": 0.0}
    return {"predicted_per_token_ms": ms / steps, "predicted_per_second": 1e3 / ms * steps}


def final_timings(final: Done) -> dict[str, Any]:
    """A finished choice's ``timings`` from its done event's stats and token counts."""
    stats = final.stats
    times = stats.get("time_s", {})
    prefill_ms = times.get("prefill", 0.0) * 1000
    predicted_ms = max(0.0, times.get("total", 0.0) * 1000 - prefill_ms - times.get("queue", 0.0) * 1000)
    return timings(final.prompt_tokens, stats.get("reused_prompt_tokens", 0), prefill_ms,
                   final.completion_tokens, predicted_ms, stats.get("n_drafted", 0), stats.get("n_accepted", 0))


def progress_timings(event: Progress) -> dict[str, Any]:
    """A prompt progress event's ``timings`` (llama-server's, where ``timings_per_token`` asks for them): the
    prompt tokens processed past the cached prefix so far and the time they took; nothing generated yet."""
    return timings(event.processed, event.cache, event.prompt_ms, 0, 0.0, 0, 0)


def live_timings(job: Any, predicted: int) -> dict[str, Any] | None:
    """A streaming choice's ``timings`` so far, ``predicted`` tokens sent (None: its generation runs elsewhere, a
    scale-out replica, and has no live counters here)."""
    gen = job.gen
    if gen is None:
        return None
    stats = gen.stats
    prefill_ms = stats.prefill_s * 1000
    predicted_ms = max(0.0, (time.perf_counter() - gen.started) * 1000 - prefill_ms)
    return timings(len(job.prompt_ids), stats.n_reused, prefill_ms, predicted, predicted_ms, stats.n_drafted,
                   stats.n_accepted)


def prompt_progress(job: Any) -> dict[str, Any]:
    """How far the prompt's processing is once generation has begun: all of it, its reused tokens as ``cache``."""
    gen = getattr(job, "gen", None)
    stats = getattr(gen, "stats", None)
    total = len(job.prompt_ids)
    return {"total": total, "cache": getattr(stats, "n_reused", 0), "processed": total,
            "time_ms": getattr(stats, "prefill_s", 0.0) * 1000}
