"""Prompt lookup decoding: copy what followed an earlier occurrence of the current suffix.

Saxena 2023 (apoorvumang/prompt-lookup-decoding).  Unlike the reference and
llama-cpp-python's version, which rescan the whole history every step and
take the first match, this keeps an incremental index (one dict per n-gram
length, n-gram -> end position of its most recent occurrence) and prefers
the longest, most recent match.  Each draft carries its evidence: how many tokens
the match runs back (``match_probs``), so that the cost policy verifies a copy
of a prompt's line whole, every step, and a coincidence not at all.

A match of ``RESYNC`` tokens or more starts a copy cursor (``retrieval.rewrites``), which follows the document
through the answer's edits: where the answer renames a name the prompt uses, later copies draft the new name.

Example with n_min=1, n_max=2 and context ``[1, 2, 3, 9, 1, 2]``: the
suffix ``(1, 2)`` last occurred ending at position 2, so the draft is the
tokens from there, ``[3, 9, 1, 2]`` (capped at k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import InvalidParameterError
from ..retrieval.lookup import going_on
from ..retrieval.rewrites import MAX_SPAN, Position, Rewrites
from ..types import Draft
from .base import BuildContext, DraftRequest, LlamaCpp, config_from_options, register

NAME = "prompt-lookup"  # its registry name, for those that name it (default method lists, messages)


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


MAX_MATCH = 64  # how far back a match is followed for its length
RESYNC = 3  # a match this long starts the copy cursor, and after a break teaches the rewrite it stepped over


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

    def find(self, after: Sequence[int] = ()) -> tuple[int, int] | None:
        """(start of the continuation, match length) of the longest matching suffix, if any; ``after``: tokens that
        follow the indexed ones in the context asked about (a draft so far), not indexed themselves.

        The match length goes on past ``n_max``, as far back as the earlier occurrence and the context's end agree
        (up to ``MAX_MATCH``): a line being copied from the prompt matches for dozens of tokens, a common n-gram for
        a few, and that is the evidence the draft is scored by."""
        toks = self.tokens
        tail = list(toks[-MAX_MATCH - 1:]) + [int(t) for t in after] if after else toks
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(tail) < n:
                continue
            j = self.index[n].get(tuple(tail[-n:]))
            if j is not None:
                m, back = n, len(tail)
                while m < MAX_MATCH and j - m - 1 >= 0 and m < back and toks[j - m - 1] == tail[back - m - 1]:
                    m += 1
                return j, m
        return None


class _Seq:
    """One generation: its index, and the copy its answer is following (``retrieval.rewrites``).

    ``at`` is the cursor, the copy's position after the committed tokens (None: no copy followed); ``run`` is how
    many tokens it has followed (the drafts' evidence); ``broke`` is (answer position, document position) where the
    last copy broke, from which the next resync learns what the answer wrote instead."""

    def __init__(self, config: PromptLookupConfig, prompt_ids: Sequence[int]) -> None:
        self.index = _Index(config.n_min, config.n_max)
        self.index.extend(prompt_ids)
        self.rewrites = Rewrites(len(self.index.tokens))
        self.at: Position | None = None
        self.run = 0
        self.broke: tuple[int, int] | None = None

    def follow(self, ids: Sequence[int]) -> None:
        """Walk newly committed tokens (already indexed) along the copy; a token it did not predict breaks it.  A
        rewrite the answer did not make is forgotten, and where the answer kept the document's token the copy goes
        on verbatim."""
        at = self.at
        if at is None:
            return
        toks = self.index.tokens
        base = len(toks) - len(ids)
        for i, t in enumerate(ids):
            nxt = self.rewrites.step(toks, at)
            if nxt is not None and nxt[0] != t and nxt[2]:  # a rewrite refuted: the document's own token instead
                self.rewrites.forget(nxt[2])
                nxt = None if at.pending else (toks[at.src], Position(at.src + 1), ())
            if nxt is None or nxt[0] != t:
                self.broke = None if at.pending else (base + i, at.src)
                self.at, self.run = None, 0
                return
            at = nxt[1]
        self.at, self.run = at, min(self.run + len(ids), MAX_MATCH)

    def resync(self, j: int, m: int) -> None:
        """A match of ``m`` tokens ending at ``j`` takes a copy up again.  Where it is the document a few tokens past
        the last break, the span skipped there and what the answer wrote instead are a rewrite."""
        toks = self.index.tokens
        if self.broke is not None:
            out0, src0 = self.broke
            out1, src1 = len(toks) - m, j - m
            if 0 <= src1 - src0 <= MAX_SPAN and 0 <= out1 - out0 <= MAX_SPAN and src1 <= self.rewrites.document_end:
                self.rewrites.learn(toks[src0:src1], toks[out0:out1])
            self.broke = None
        self.at, self.run = Position(j), m

    def copy(self, after: Sequence[int], n: int) -> tuple[list[int], int] | None:
        """The cursor's copy after ``after`` (tokens past the committed ones): its tokens and run; None where there
        is no cursor or ``after`` leaves the copy."""
        at = self.at
        if at is None:
            return None
        toks = self.index.tokens
        for t in after:
            nxt = self.rewrites.step(toks, at)
            if nxt is None or nxt[0] != t:
                return None
            at = nxt[1]
        return self.rewrites.copy(toks, at, n), self.run + len(after)


class PromptLookupDrafter:
    """Longest, most recent n-gram match over prompt + output, indexed incrementally per generation."""

    name = NAME
    scores_drafts = True  # each token's odds from how far the match runs back (``match_probs``)

    def __init__(self, config: PromptLookupConfig | None = None) -> None:
        self.config = config or PromptLookupConfig()
        self._seqs: dict[int, _Seq] = {}

    def begin(self, prompt_ids: Sequence[int], seq: int = 0) -> None:
        self._seqs[seq] = _Seq(self.config, prompt_ids)

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0) -> None:
        s = self._seqs.get(seq)
        if s is not None:
            s.index.extend(new_ids)
            s.follow(new_ids)

    def end(self, seq: int = 0, complete: bool = True) -> None:
        self._seqs.pop(seq, None)

    reads_context = True  # drafts after any context that extends the generation's (``Drafter.reads_context``)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [self._one(r.seq, r.context, r.budget.max_tokens) for r in requests]

    def _one(self, seq: int, context: Sequence[int], max_tokens: int) -> Draft:
        s = self._seqs.get(seq)
        if s is None or max_tokens <= 0:
            return Draft.empty(self.name)
        index = s.index
        after = context[len(index.tokens):] if len(context) > len(index.tokens) else ()
        copied = s.copy(after, max_tokens)
        if copied is None or not copied[0]:
            found = index.find(after)
            if found is None:
                return Draft.empty(self.name)
            j, m = found
            if m >= RESYNC and not after:
                s.resync(j, m)
                copied = s.copy((), max_tokens)
            else:
                copied = (index.tokens[j : j + max_tokens], m)
        tokens, m = copied
        return Draft(token_ids=tuple(tokens), source=self.name, probs=match_probs(m, len(tokens)))


def match_probs(match: int, n: int) -> tuple[float, ...]:
    """Path acceptance estimates for n copied tokens after a verbatim match of ``match`` tokens: each token goes on
    with probability 1 - 1/(match + 2) (``going_on``: Laplace's rule of succession over the match), so a long copy
    is verified whole and a one-token coincidence barely at all.  The cost policy calibrates these against outcomes."""
    go_on = going_on(match)
    out, p = [], 1.0
    for _ in range(n):
        p *= go_on
        out.append(p)
    return tuple(out)


# llama.cpp's n-gram lookups in the request's own tokens: prompt lookup matches the last n-gram in prompt and output
@register(NAME, llama=LlamaCpp(spec_types=("ngram-simple", "ngram-map-k", "ngram-map-k4v"),
                               peers=("llama-ngram-simple", "llama-lookup")))
def _build(ctx: BuildContext) -> PromptLookupDrafter:
    return PromptLookupDrafter(config_from_options(PromptLookupConfig, ctx.options))
