"""Prefix reuse: how much of a cached prompt's KV a new prompt may keep, and a host-memory cache of them.

``reusable`` is the rule that keeps reuse lossless: only KV that a cold
prefill of the new prompt would compute identically is kept.  The engine
(``Engine(prompt_cache_bytes=...)``) also saves a slot's sequence state in a
``PromptCache`` before the slot is reused, and restores the best-matching
entry later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

from .llama.batching import prefill_call
from .llama.target import EngineTarget

MIN_REUSE = 32  # a shorter shared prefix does not earn a cached slot over the least recently used one


def reusable(target: EngineTarget, cached: Sequence[int], prefilled: int, prompt: Sequence[int]) -> int:
    """How much of a cached KV (``cached`` tokens) a cold prefill of ``prompt`` would compute identically.

    Where prefill calls and decode steps compute KV alike (measured:
    ``shapes.prefill_exact``), the whole common prefix.  Otherwise only
    tokens the earlier prompt's prefill computed, up to a prefill call's
    edge, so the rest is prefilled in the very calls a cold run makes; or
    all of them where ``prompt`` prefills exactly as far (the same prompt
    again: its last, partial call was the same call too).
    """
    limit = min(len(cached), len(prompt) - 1)
    m = 0
    while m < limit and cached[m] == prompt[m]:
        m += 1
    if target.is_recurrent and m < len(cached):
        return 0  # a recurrent state holds all of ``cached``: it cannot be cut back to a shorter prefix
    if not target.shapes.prefill_exact:
        if m == prefilled == len(prompt) - 1:
            return m  # a prefill runs all but the last token, in calls fixed by that length (LlamaModel.prefill)
        m = min(m, prefilled)
        m -= m % prefill_call(target.config.prefill_chunk, target.batch_cap)
    return m


def worth_reusing(target: EngineTarget, cached: Sequence[int], prefilled: int, prompt: Sequence[int]) -> int:
    """A cached prefix's reusable part, or 0 when it is too short to be worth overwriting a slot's cache
    (a shared BOS alone would otherwise send every request to the same slot)."""
    m = reusable(target, cached, prefilled, prompt)
    return m if m >= min(MIN_REUSE, len(prompt) - 1) else 0


@dataclass
class _Saved:
    tokens: list[int]
    prefilled: int
    data: bytes
    used: float
    # What the slot's drafter held for this prefix (``Drafter.save_prefix``: an MTP head's KV and the target's
    # rows it read), restored with the KV so that the drafter need not start over; None: nothing to restore.
    drafter: Any = None
    drafter_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return len(self.data) + self.drafter_bytes


class PromptCache:
    """Finished prompts' KV in host memory (llama.cpp's per-sequence state), least recently used first out.

    Slots hold one cached prefix each; this keeps more of them (llama-server's
    ``--cache-ram``), so a prompt that comes back after its slot was reused is
    restored with a memory copy instead of a prefill.  A restored sequence has
    exactly the cells it had, so output does not change (tested).
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.entries: list[_Saved] = []
        self.bytes = 0
        self.hits = 0

    def put(self, tokens: Sequence[int], prefilled: int, data: bytes, drafter: Any = None, drafter_bytes: int = 0) -> None:
        """Keep ``data`` (the sequence's KV) for ``tokens``, and the drafter's state for them, within the budget."""
        self.entries = [e for e in self.entries if e.tokens != list(tokens)]
        self.entries.append(_Saved(list(tokens), prefilled, data, time.perf_counter(), drafter, drafter_bytes))
        self.bytes = sum(e.nbytes for e in self.entries)
        while self.bytes > self.budget and self.entries:
            oldest = min(self.entries, key=lambda e: e.used)
            self.entries.remove(oldest)
            self.bytes -= oldest.nbytes

    def clear(self) -> None:
        self.entries, self.bytes = [], 0

    def best(self, score) -> tuple[_Saved | None, int]:
        """The entry with the highest ``score(entry)`` (reusable tokens), and that score."""
        best, top = None, 0
        for e in self.entries:
            m = score(e)
            if m > top:
                best, top = e, m
        if best is not None:
            best.used = time.perf_counter()
        return best, top
