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
from .base import BuildContext, config_from_options, register


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


class PromptLookupDrafter:
    """Longest, most recent n-gram match over prompt + output, indexed incrementally."""

    name = "prompt-lookup"

    def __init__(self, config: PromptLookupConfig | None = None) -> None:
        self.config = config or PromptLookupConfig()
        self._tokens: list[int] = []
        # _index[n][ngram] = j: tokens[j-n:j] == ngram and tokens[j] exists.
        self._index: dict[int, dict[tuple[int, ...], int]] = {}

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self._tokens = []
        self._index = {n: {} for n in range(self.config.n_min, self.config.n_max + 1)}
        self._extend(prompt_ids)

    def observe(self, new_ids: Sequence[int], num_accepted: int) -> None:
        self._extend(new_ids)

    def end(self) -> None:
        self._tokens = []
        self._index = {}

    def propose(self, context_ids: Sequence[int], max_tokens: int) -> Draft:
        j = self._find_match()
        if j is None or max_tokens <= 0:
            return Draft.empty(self.name)
        return Draft(token_ids=tuple(self._tokens[j : j + max_tokens]), source=self.name)

    def _extend(self, ids: Sequence[int]) -> None:
        """Append tokens; each new token gives the n-grams just before it a follower."""
        toks = self._tokens
        for t in ids:
            j = len(toks)  # position of the token being appended
            for n, table in self._index.items():
                if j >= n:
                    table[tuple(toks[j - n : j])] = j
            toks.append(int(t))

    def _find_match(self) -> int | None:
        """Start position of the continuation of the longest matching suffix, if any."""
        toks = self._tokens
        for n in range(self.config.n_max, self.config.n_min - 1, -1):
            if len(toks) < n:
                continue
            j = self._index[n].get(tuple(toks[-n:]))
            if j is not None:
                return j
        return None


@register("prompt-lookup")
def _build(ctx: BuildContext) -> PromptLookupDrafter:
    return PromptLookupDrafter(config_from_options(PromptLookupConfig, ctx.options))
