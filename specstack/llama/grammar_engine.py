"""The constraint engine's interface, without llama_cpp or llguidance: what a grammar's parse state answers
(``GrammarState``), what it can do beyond that (``GrammarTraits``), and a vocabulary's engine that builds those
states (``GrammarEngine``).

Two engines implement it: llguidance (``guidance.GuidedGrammar``) and llama.cpp's grammar sampler
(``grammar.Grammar``); which one runs a grammar is decided in one place, ``grammar.choose_engine``, and nothing
outside ``llama/grammar.py`` and ``llama/guidance.py`` knows which is behind a state.  What the engines do
differently is a trait each state declares (``traits``), read where it matters (a lazy grammar's trigger text,
the grammar draft source, learnt spellings), never found out by probing attributes.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np


@dataclass(frozen=True)
class GrammarTraits:
    """What a grammar state can do beyond every state's questions."""

    # Takes text (``GrammarState.feed``): a lazy grammar (``constraints.Constraints.grammar_triggers``) is fed its
    # trigger's text, and starts from there.
    lazy: bool
    # Says which tokens it forces next (``GrammarState.forced``): the grammar draft source proposes them.
    forces: bool
    # Learns how the model spelled text it forced (``GrammarState.learn``), for the grammar source's next drafts.
    learns: bool


class GrammarState(Protocol):
    """One grammar's parse state over one vocabulary: one generation's, advanced by its committed tokens.

    A draft is walked on a ``copy`` (the committed state never sees a token the target did not take: a copy is
    how a state is rolled back), ``allowed`` asks about a few candidate ids (the greedy path: the constrained
    argmax is almost always among the best logits), ``mask`` about the whole vocabulary (sampling), and
    ``best_allowed`` finds the constrained argmax the way this engine's masks are cheapest."""

    engine: str  # which engine runs it ("llguidance", "llama.cpp"): for messages and tests, never for decisions
    traits: GrammarTraits
    gbnf: str
    n_vocab: int

    @property
    def error(self) -> str:
        """Why the engine gave up on this state ("" while it has not)."""

    def copy(self) -> "GrammarState":
        """An independent copy of this parse state."""

    def allowed(self, token_ids: Sequence[int]) -> list[bool]:
        """Whether each of ``token_ids`` may come next (an end-of-generation token only where the grammar can end)."""

    def mask(self) -> np.ndarray:
        """A [n_vocab] bool array: which tokens the grammar allows next."""

    def best_allowed(self, row: np.ndarray) -> int | None:
        """The allowed token of ``row``'s highest finite logit, ties to the lower id (as ``argmax``); None where none
        is."""

    def accept(self, token_id: int) -> None:
        """Advance by one token, which must be allowed (``ValueError`` otherwise)."""

    def walk(self, token_ids: Sequence[int]) -> int:
        """Advance along ``token_ids`` as far as the grammar allows them; how many it took."""

    def feed(self, text: bytes) -> bool:
        """Advance by ``text`` (``traits.lazy`` only): whether the grammar allowed it; where it did not, the state
        allows nothing from then on."""

    def forced(self) -> list[int]:
        """The tokens the grammar forces next ([] where ``traits.forces`` is False)."""

    def learn(self, token_ids: Sequence[int]) -> int:
        """From this state on, learn from a finished answer how the model spells forced text; how many spellings
        differed from the tokenizer's (0 where ``traits.learns`` is False)."""


class GrammarEngine(Protocol):
    """A vocabulary's grammar engine: start states built once per grammar text, off the caller's thread, so that
    a role's engine thread only copies them (``grammar.GrammarCache``)."""

    def prepare(self, gbnf: str) -> "Future[GrammarState]":
        """The start state of ``gbnf``, built (or being built) on the grammar thread; a grammar refused is the
        future's ``InvalidParameterError``."""

    def get(self, gbnf: str) -> GrammarState:
        """A fresh copy of ``gbnf``'s start state (built now if it was not prepared)."""

    def warm(self) -> "Future[Any]":
        """Build what every grammar of this vocabulary needs (the engine's view of the vocabulary) ahead, off the
        caller's thread: a server does it at load, so that its first constrained request does not wait for it."""
