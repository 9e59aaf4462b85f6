"""Finished prompts' KV kept in host memory, so a prompt that comes back skips its prefill.

The engine (``Engine(prompt_cache_bytes=...)``) saves a slot's sequence state
here before the slot is reused and restores the best-matching entry later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence


@dataclass
class _Saved:
    tokens: list[int]
    prefilled: int
    data: bytes
    used: float


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

    def put(self, tokens: Sequence[int], prefilled: int, data: bytes) -> None:
        self.entries = [e for e in self.entries if e.tokens != list(tokens)]
        self.entries.append(_Saved(list(tokens), prefilled, data, time.perf_counter()))
        self.bytes = sum(len(e.data) for e in self.entries)
        while self.bytes > self.budget and self.entries:
            oldest = min(self.entries, key=lambda e: e.used)
            self.entries.remove(oldest)
            self.bytes -= len(oldest.data)

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
