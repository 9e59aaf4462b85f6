"""The ``grammar`` draft source: what a request's grammar forces next, proposed as draft tokens.

A constrained answer (a JSON schema, a tool call, a GBNF grammar) spends many of its tokens on text the grammar
decides alone: keys, quotes, brackets, a tool call's envelope.  After the committed tokens and the other source's
draft (walked through the grammar, cut at its first refused token), the grammar's forced continuation is appended:
llguidance's fast-forward tokens (``GuidedGrammar.forced``), the forced bytes tokenized as the model's tokenizer
would, stopping before a token that the bytes after them could still merge into.  The result is an ordinary draft,
verified like any other, so the output is exactly what constrained plain decoding gives; unlike SGLang's
jump-forward decoding, nothing is committed unverified, so a model that would tokenize the forced text otherwise
(``"`` then ``name`` where the draft says ``"name``) keeps its own tokens.

The engine composes it for every generation whose constraints carry a grammar (``Engine._propose``), with the
generation's own drafter as the other source; each token keeps its source in ``Draft.origins``, so
``speculative.by_source`` counts the grammar's tokens under ``grammar``.  Forced tokens carry a score
(``FORCED_SCORE``) that the cost policy calibrates against outcomes like any scored source's.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from ..types import Draft

SOURCE = "grammar"
FORCED_SCORE = 0.95  # a forced token's prior chance of acceptance (a model may tokenize the forced text otherwise)


class Forcing(Protocol):
    """A grammar state that can say what it forces (``llama.guidance.GuidedGrammar``; llama.cpp's says nothing)."""

    def copy(self) -> "Forcing": ...

    def walk(self, token_ids: Sequence[int]) -> int: ...

    def forced(self) -> list[int]: ...


def with_forced(draft: Draft, grammar: Forcing, cap: int) -> Draft:
    """``draft`` cut at its first token ``grammar`` refuses, then the grammar's forced tokens after it, within
    ``cap`` tokens in all.  ``grammar`` is the committed state; it is walked on a copy."""
    state = grammar.copy()
    n = state.walk(draft.token_ids[:cap])
    base = draft.truncated(n)
    forced = state.forced()[: max(cap - n, 0)] if n < cap else []
    if not forced:
        return base
    origins = tuple(base.origin(i) for i in range(n)) + (SOURCE,) * len(forced)
    return Draft(token_ids=tuple(base.token_ids) + tuple(forced), source=base.source if n else SOURCE,
                 probs=_path_probs(base, n, len(forced)), origins=origins)


def _path_probs(base: Draft, n: int, n_forced: int) -> tuple[float, ...] | None:
    """Path acceptance estimates of ``base``'s first ``n`` tokens followed by ``n_forced`` forced ones; None where
    ``base`` drafted tokens without estimates (a model's draft is priced by its source's record instead)."""
    if n and base.probs is None:
        return None
    probs = list(base.probs[:n]) if n else []
    path = probs[-1] if probs else 1.0
    for _ in range(n_forced):
        path *= FORCED_SCORE
        probs.append(path)
    return tuple(probs)
