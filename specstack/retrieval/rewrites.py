"""Copying a document with the edits the answer has already made to it.

A grounded edit ("rename ``obj`` to ``value`` everywhere, return the function") copies the prompt, but not verbatim:
every occurrence of ``obj`` comes back as ``value``.  A plain copy breaks at each of them, and an n-gram lookup then
needs a few more tokens before the context matches the prompt again, so each occurrence costs the drafter several
steps.  Here a copy is followed by a cursor into the document.  Where the cursor breaks and a later match takes up
the document again a few tokens on, the span it skipped and the tokens the answer wrote instead are a rewrite
(``obj`` -> ``value``), and later copies apply it: the drafts then spell the edit the answer is making, and the cursor
steps over it.  A rewrite that a later verification refutes is forgotten.  What is drafted is still only a guess
that the target verifies, so output is unchanged; what changes is how often a copy is there to verify.

Example: the document is ``[5, 1, 7, 5, 2]`` (``1`` the old name), the answer so far ``[5, 9, 7]``.  The cursor broke
at ``9`` (the document said ``1``), and the match of ``[7]`` took the document up again one token on: the rewrite
``(1,) -> (9,)`` is learnt, and a copy from ``5`` now drafts ``[5, 9]`` where the document says ``[5, 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

MAX_SPAN = 8  # a rewrite replaces at most this many tokens with at most this many
MAX_RULES = 64  # rewrites kept per generation (an edit makes a few)


@dataclass(frozen=True, slots=True)
class Position:
    """Where a copy stands: ``src`` indexes the token list copied from; ``pending`` are a rewrite's tokens still to
    come before it (a rewrite of two or more tokens is partly through)."""

    src: int
    pending: tuple[int, ...] = ()
    rule: tuple[int, ...] = ()  # the span of the rewrite whose tokens are pending (to forget it if refuted)


class Rewrites:
    """One generation's learnt rewrites (document span -> answer span), applied to copies from the document."""

    def __init__(self, document_end: int) -> None:
        self.document_end = document_end  # rewrites apply to copies from tokens[:document_end] (the prompt)
        self._rules: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}  # first token of span -> rules
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def learn(self, span: Sequence[int], answer: Sequence[int]) -> None:
        """Keep ``span`` -> ``answer`` if it is a plausible edit: a non-empty span, both short, not the same."""
        span, answer = tuple(span), tuple(answer)
        if not span or len(span) > MAX_SPAN or len(answer) > MAX_SPAN or span == answer or self._count >= MAX_RULES:
            return
        rules = self._rules.setdefault(span[0], [])
        rules[:] = [r for r in rules if r[0] != span]  # the newer reading of a span wins
        rules.insert(0, (span, answer))
        self._count = sum(len(v) for v in self._rules.values())

    def forget(self, span: Sequence[int]) -> None:
        """Drop the rewrite of ``span``: a verification refuted it."""
        rules = self._rules.get(span[0]) if span else None
        if rules:
            rules[:] = [r for r in rules if r[0] != tuple(span)]
            self._count = sum(len(v) for v in self._rules.values())

    def step(self, tokens: Sequence[int], at: Position) -> tuple[int, Position, tuple[int, ...]] | None:
        """The copy's next token from ``at``, the position after it and the span of the rewrite it comes from (empty
        for a verbatim token); None at the end of ``tokens``."""
        if at.pending:
            rest = at.pending[1:]
            return at.pending[0], Position(at.src, rest, at.rule if rest else ()), at.rule
        src = at.src
        if src >= len(tokens):
            return None
        if self._count and src < self.document_end:
            for span, answer in self._rules.get(tokens[src], ()):
                end = src + len(span)
                if end <= self.document_end and tuple(tokens[src:end]) == span:
                    if not answer:  # a deletion: the copy goes on after the span
                        nxt = self.step(tokens, Position(end))
                        return None if nxt is None else (nxt[0], nxt[1], span)
                    rest = answer[1:]
                    return answer[0], Position(end, rest, span if rest else ()), span
        return tokens[src], Position(src + 1), ()

    def copy(self, tokens: Sequence[int], at: Position, n: int) -> list[int]:
        """Up to ``n`` tokens of the copy from ``at``."""
        if not at.pending and (not self._count or at.src >= self.document_end):
            return list(tokens[at.src:at.src + n])  # verbatim: a slice (a look every step must stay cheap)
        out: list[int] = []
        while len(out) < n:
            nxt = self.step(tokens, at)
            if nxt is None:
                break
            out.append(nxt[0])
            at = nxt[1]
        return out
