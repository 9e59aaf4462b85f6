"""The ``grammar`` draft source: what a request's grammar forces next, proposed as draft tokens.

A constrained answer (a JSON schema, a tool call, a GBNF grammar) spends many of its tokens on text the grammar
decides alone: keys, quotes, brackets, a tool call's envelope.  After the committed tokens and the other source's
draft (walked through the grammar, cut at its first refused token), the grammar's forced continuation is appended:
the grammar state's forced tokens (``GrammarState.forced``: the forced bytes tokenized as the model's tokenizer would,
stopping before a token that the bytes after them could still merge into; a state that cannot say what it forces,
``traits.forces`` False, proposes none, and the other source's draft is only cut).  The result is an ordinary draft,
verified like any other, so the output is exactly what constrained plain decoding gives; unlike SGLang's
jump-forward decoding, nothing is committed unverified, so a model that would tokenize the forced text otherwise
(``"`` then ``name`` where the draft says ``"name``) keeps its own tokens.

The engine composes it for every generation whose constraints carry a grammar (``Engine._propose``), with the
generation's own drafter as the other source; each token keeps its source in ``Draft.origins``, so
``speculative.by_source`` counts the grammar's tokens under ``grammar``.  Forced tokens carry a score
(``FORCED_SCORE``) that the cost policy calibrates against outcomes like any scored source's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from ..types import Draft

if TYPE_CHECKING:
    from ..llama.grammar_engine import GrammarState

SOURCE = "grammar"
FORCED_SCORE = 0.95  # a forced token's prior chance of acceptance (a model may tokenize the forced text otherwise)


Ask = Callable[[Sequence[int], int], Draft]  # (tokens after the committed ones, budget) -> the other source's draft
ROUNDS = 4  # forced text and the other source's text alternate at most this often in one draft


def with_forced(draft: Draft, grammar: "GrammarState", cap: int, ask: Ask | None = None) -> Draft:
    """The grammar's forced tokens and the other source's draft, alternating, within ``cap`` tokens in all.

    Where the grammar forces text after the committed tokens and the other source can draft after any context
    (``ask``: prompt lookup, suffix trees), the forced tokens come first, the likeliest of all, then that source's
    draft after them, then what the grammar forces after that, and so on.  Otherwise ``draft`` (the other source's,
    from the committed tokens) comes first, cut at its first token the grammar refuses, and the forced tokens follow;
    so too where ``draft`` spells the forced text with other tokens than the canonical ones (``_spells_otherwise``).
    ``grammar`` is the committed state; it is walked on a copy."""
    state = grammar.copy()
    chain = _Chain()
    forced = state.forced()[:cap] if ask is not None else []
    if forced and _spells_otherwise(draft, state, forced[0]):
        forced = []  # the other source's spelling of the forced text goes first
    if not forced:
        chain.add(draft, state.walk(draft.token_ids[:cap]))
        forced = state.forced()[: cap - len(chain)]
    for _ in range(ROUNDS):
        forced = forced[: state.walk(forced)]  # the state moves past them (each spells forced text: allowed)
        chain.force(forced)
        if ask is None or len(chain) >= cap or not forced:
            break
        more = ask(chain.tokens, cap - len(chain))
        taken = state.walk(more.token_ids[: cap - len(chain)])
        if not taken:
            break
        chain.add(more, taken)
        forced = state.forced()[: cap - len(chain)]
    return chain.draft(draft)


def _spells_otherwise(draft: Draft, state: "GrammarState", first_forced: int) -> bool:
    """Whether the other source's draft (from the committed tokens) spells the forced text with other tokens than
    the tokenizer's canonical ones, in a way the grammar takes: then it goes first.  Its draft copies text the model
    wrote (its own earlier output, in a suffix tree) or read, and a model does not always spell text canonically:
    Gemma 3 270M, constrained, writes ``d`` ``ue`` ``_`` ``day`` ``s`` where the tokenizer says ``due`` ``_``
    ``days``, so the canonical draft fails at its first token where the copy holds.  The grammar refuses any token
    that leaves the forced bytes, so a token it takes can only differ in its spelling of them."""
    if not draft.token_ids or draft.token_ids[0] == first_forced:
        return False  # nothing to copy, or the same first token: the forced text first, the copy asked after it
    return state.allowed(draft.token_ids[:1])[0]


class _Chain:
    """A draft being put together from several sources: tokens, each one's source, path acceptance estimates."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.origins: list[str] = []
        self.probs: list[float] | None = []
        self.forced = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, part: Draft, n: int) -> None:
        """The first ``n`` tokens of ``part``, with its estimates scaled to follow the path so far."""
        if n == 0:
            return
        self.tokens.extend(part.token_ids[:n])
        self.origins.extend(part.origin(i) for i in range(n))
        scores = part.scores()
        if scores is None or self.probs is None:
            self.probs = None  # a model's draft is priced by its source's record instead
            return
        path = self.probs[-1] if self.probs else 1.0
        for p in scores[:n]:
            path *= p
            self.probs.append(path)

    def force(self, forced: Sequence[int]) -> None:
        self.tokens.extend(forced)
        self.origins.extend([SOURCE] * len(forced))
        self.forced += len(forced)
        if self.probs is not None:
            path = self.probs[-1] if self.probs else 1.0
            for _ in forced:
                path *= FORCED_SCORE
                self.probs.append(path)

    def draft(self, first: Draft) -> Draft:
        """The chain as one draft, named for its first token's source; ``first`` cut to its walked part where nothing
        was forced (the other source is asked again only after forced text)."""
        if not self.forced:
            return first.truncated(len(self.tokens))
        return Draft(token_ids=tuple(self.tokens), source=self.origins[0],
                     probs=None if self.probs is None else tuple(self.probs), origins=tuple(self.origins))
