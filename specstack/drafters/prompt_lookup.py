"""Prompt lookup decoding: copy what followed an earlier occurrence of the current suffix.

Saxena 2023 (apoorvumang/prompt-lookup-decoding).  Unlike the reference and
llama-cpp-python's version, which rescan the whole history every step and
take the first match, this keeps an incremental index (one dict per n-gram
length, n-gram -> end position of its most recent occurrence) and prefers
the longest, most recent match.

Example with n_min=1, n_max=2 and context ``[1, 2, 3, 9, 1, 2]``: the
suffix ``(1, 2)`` last occurred ending at position 2, so the draft is the
tokens from there, ``[3, 9, 1, 2]`` (capped at k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import InvalidParameterError
from ..types import Draft
from .base import BuildContext, DraftRequest, config_from_options, register


@dataclass(frozen=True)
class PromptLookupConfig:
    """n_min/n_max: shortest and longest suffix n-gram to match."""

    n_min: int = 1
    n_max: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.n_min <= self.n_max:
            raise InvalidParameterError(
                f"prompt-lookup needs 1 <= n_min <= n_max (got n_min={self.n_min}, n_max={self.n_max})"
            )


class _Index:
    """One generation's tokens and n-gram index: _index[n][ngram] = j with tokens[j-n:j] == ngram."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.tokens: list[int] = []
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.n_min, self.n_max = n_min, n_max

    def extend(self, ids: Sequence[int]) -> None:
        """Append tokens; each new token gives the n-grams just before it a follower."""
        toks = self.tokens
        for t in ids:
            j = len(toks)  # position of the token being appended
            for n, table in self.index.items():
                if j >= n:
                    table[tuple(toks[j - n : j])] = j
            toks.append(int(t))

    def find(self) -> int | None:
        """Start position of the continuation of the longest matching suffix, if any."""
        toks = self.tokens
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(toks) < n:
                continue
            j = self.index[n].get(tuple(toks[-n:]))
            if j is not None:
                return j
        return None


class PromptLookupDrafter:
    """Longest, most recent n-gram match over prompt + output, indexed incrementally per generation."""

    name = "prompt-lookup"

    def __init__(self, config: PromptLookupConfig | None = None) -> None:
        self.config = config or PromptLookupConfig()
        self._seqs: dict[int, _Index] = {}

    def begin(self, prompt_ids: Sequence[int], seq: int = 0) -> None:
        index = self._seqs[seq] = _Index(self.config.n_min, self.config.n_max)
        index.extend(prompt_ids)

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0) -> None:
        index = self._seqs.get(seq)
        if index is not None:
            index.extend(new_ids)

    def end(self, seq: int = 0, complete: bool = True) -> None:
        self._seqs.pop(seq, None)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [self._one(r.seq, r.budget.max_tokens) for r in requests]

    def _one(self, seq: int, max_tokens: int) -> Draft:
        index = self._seqs.get(seq)
        j = index.find() if index is not None and max_tokens > 0 else None
        if j is None:
            return Draft.empty(self.name)
        return Draft(token_ids=tuple(index.tokens[j : j + max_tokens]), source=self.name)


@register("prompt-lookup")
def _build(ctx: BuildContext) -> PromptLookupDrafter:
    return PromptLookupDrafter(config_from_options(PromptLookupConfig, ctx.options))
