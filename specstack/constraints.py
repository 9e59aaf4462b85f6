"""What a request does to the target's logits before choosing a token: logit bias, penalties, min_tokens, a grammar.

Plain and speculative decoding must choose from the same distribution at every position, so each
verification row is shaped with the history plain decoding would have there: row i of a step sees
the context plus the first i draft tokens (for the penalties' window and ``min_tokens``) and the
grammar state advanced along those draft tokens.  The order is llama.cpp's sampler chain: logit
bias, then penalties (``llama_sampler_init_penalties``: over the last ``repeat_last_n`` tokens of
prompt and output, a logit ``l`` of a token seen ``c`` times becomes ``l / r`` if ``l > 0`` else ``l * r``,
minus ``c * frequency_penalty + presence_penalty``), then the grammar, then the sampling filters of
``sampling.target_probs``.

Greedy rows look for the constrained argmax among the best logits first and ask the grammar about the
whole vocabulary only when none of them is allowed (as llama-server checks its sampled token first).
A draft is cut at its first token the grammar refuses, before it costs a verification row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .errors import InvalidParameterError
from .sampling import SamplingParams, target_probs

if TYPE_CHECKING:
    from .llama.grammar_engine import GrammarState

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit bias


@dataclass(frozen=True)
class Constraints:
    """A request's logit controls.  The defaults change nothing (``active`` is False)."""

    repeat_penalty: float = 1.0  # 1.0 = off
    repeat_last_n: int = 64  # tokens of history the penalties look at; 0 = none, -1 = the whole context
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); -inf bans the token
    min_tokens: int = 0  # no end of generation (or stop token) before this many output tokens
    ignore_eos: bool = False  # end-of-generation tokens are banned (llama-server's ignore_eos)
    grammar: str | None = None  # GBNF (llama.cpp's), enforced by the target's grammar engine (``llama.grammar_engine``)
    # Lazy grammar (llama.cpp's grammar_lazy): free text until the output contains one of these words, then the
    # grammar, which must match from the trigger on (a tool call's opening, under tool_choice "auto").
    grammar_triggers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (self.repeat_penalty > 0.0 and np.isfinite(self.repeat_penalty)):
            raise InvalidParameterError(f"repeat_penalty must be > 0 (got {self.repeat_penalty}); use 1.0 for none")
        if self.repeat_last_n < -1:
            raise InvalidParameterError(f"repeat_last_n must be >= -1 (got {self.repeat_last_n}); -1 means the "
                                        "whole context, 0 no penalty window")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidParameterError(f"{name} must be in [-2, 2] (got {value}), as in the OpenAI API")
        for tok, bias in self.logit_bias:
            if tok < 0:
                raise InvalidParameterError(f"logit_bias: token id {tok} is negative")
            if not (bias == -np.inf or -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT):
                raise InvalidParameterError(f"logit_bias for token {tok} must be in [-100, 100] (got {bias})")
        if self.min_tokens < 0:
            raise InvalidParameterError(f"min_tokens must be >= 0 (got {self.min_tokens})")
        if self.grammar is not None and not self.grammar.strip():
            raise InvalidParameterError("grammar is empty; leave it out for unconstrained output")
        if self.grammar_triggers and (self.grammar is None or not all(self.grammar_triggers)):
            raise InvalidParameterError("grammar_triggers need a grammar, and each trigger some text")

    @property
    def penalized(self) -> bool:
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                                            or self.presence_penalty != 0.0)

    @property
    def active(self) -> bool:
        return bool(self.penalized or self.logit_bias or self.min_tokens or self.ignore_eos or self.grammar)


class ConstraintState:
    """One generation's constraints as they stand after its committed tokens.

    ``cut`` walks a draft through a copy of the grammar, ``choose`` and ``probs`` shape the verification
    rows along the draft (on another copy), and ``commit`` advances the state by the tokens the step
    committed: the committed state never sees a draft token the target did not take.
    """

    def __init__(self, constraints: Constraints, n_vocab: int, eog_ids: frozenset[int],
                 stop_ids: frozenset[int] = frozenset(), grammar: "GrammarState | None" = None,
                 token_bytes: Callable[[int], bytes] | None = None) -> None:
        self.c = constraints
        self.n_vocab = n_vocab
        # A lazy grammar waits (``_lazy``) with the output's text until a trigger; then ``grammar`` is its state.
        self._lazy = _Lazy(grammar, constraints.grammar_triggers, token_bytes) if constraints.grammar_triggers \
            and grammar is not None else None
        self.grammar = None if self._lazy is not None else grammar
        # The start state, for ``learn`` (where the engine learns; a lazy grammar's start is wherever its trigger came).
        self._origin = grammar.copy() if self.grammar is not None and grammar.traits.learns else None
        self._waiting = b""  # a lazy grammar's output text so far, while no trigger has come
        bias = {t: b for t, b in constraints.logit_bias}
        bad = [t for t in bias if t >= n_vocab]
        if bad:
            raise InvalidParameterError(f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
        if constraints.ignore_eos:
            bias.update({t: -np.inf for t in eog_ids})
        self._bias_ids = np.array(sorted(bias), dtype=np.int64)
        self._bias = np.array([bias[t] for t in sorted(bias)], dtype=np.float32)
        self._ends = np.array(sorted(eog_ids | stop_ids), dtype=np.int64)
        # Whether a row needs a shaped copy at all (a grammar alone only picks among the row's own values).
        self._shapes = bool(len(self._bias_ids) or constraints.penalized or constraints.min_tokens)
        self.dead_row: int | None = None  # the last verification's first row where nothing was allowed

    # -- the draft -----------------------------------------------------------

    def cut(self, draft: Sequence[int]) -> int:
        """How many of ``draft``'s tokens the grammar allows in a row (walked on a copy of the state)."""
        if self.grammar is None:
            return len(draft)
        return self.grammar.copy().walk(draft)  # one copy a walk: a large grammar (many tools) copies in ~0.5 ms

    # -- the verification rows ----------------------------------------------

    def choose(self, logits: np.ndarray, draft: Sequence[int], context: Sequence[int], n_output: int) -> list[int]:
        """The target's constrained argmax at each row, stopping at the first row that disagrees with the draft.

        Row i conditions on ``context + draft[:i]``; a row past a disagreement is never needed.
        """
        state, waiting = self._start()
        choices: list[int] = []
        self.dead_row = None
        for i in range(len(draft) + 1):
            row = self.shaped(logits[i], context, draft[:i], n_output + i) if self._shapes else logits[i]
            choice = self._argmax(row, state)
            if choice is None:  # nothing allowed: the row's token is a placeholder the engine drops (``dead_row``)
                self.dead_row = i
                choices.append(self.n_vocab)
                break
            choices.append(choice)
            if i == len(draft) or choices[-1] != draft[i]:
                break
            state, waiting = self._next(state, waiting, draft[i])
        return choices

    def probs(self, logits: np.ndarray, draft: Sequence[int], context: Sequence[int], n_output: int,
              sampling: SamplingParams) -> np.ndarray:
        """p at each of the k + 1 rows, from the shaped logits (the grammar masks the whole vocabulary)."""
        state, waiting = self._start()
        rows = []
        self.dead_row = None
        for i in range(len(draft) + 1):
            row = self.shaped(logits[i], context, draft[:i], n_output + i)
            if state is not None:
                row[~state.mask()] = -np.inf
            if i < len(draft) and np.isfinite(row[draft[i]]):  # past a refused token the rows are never read
                state, waiting = self._next(state, waiting, draft[i])
            if not np.isfinite(row.max()):
                row[self._ends[:1] if len(self._ends) else 0] = 0.0  # nothing allowed: a placeholder token ...
                if self.dead_row is None:
                    self.dead_row = i  # ... the engine drops, ending the generation there (``dead_row``)
            rows.append(row)
        return target_probs(np.stack(rows), sampling)

    def shaped(self, row: np.ndarray, context: Sequence[int], drafted: Sequence[int], position: int) -> np.ndarray:
        """A float32 copy of one row of logits with bias, penalties and min_tokens applied (not the grammar)."""
        out = np.array(row, dtype=np.float32, copy=True)
        if len(self._bias_ids):
            out[self._bias_ids] += self._bias
        if self.c.penalized:
            self._penalize(out, context, drafted)
        if position < self.c.min_tokens and len(self._ends):
            out[self._ends] = -np.inf
        return out

    def _penalize(self, out: np.ndarray, context: Sequence[int], drafted: Sequence[int]) -> None:
        n = self.c.repeat_last_n
        if n < 0:
            window = list(context) + list(drafted)
        else:
            window = (list(context[-n:]) + list(drafted))[-n:]
        if not window:
            return
        ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        vals = out[ids]
        r = self.c.repeat_penalty
        vals = np.where(vals <= 0, vals * r, vals / r)
        vals -= counts * self.c.frequency_penalty + self.c.presence_penalty
        out[ids] = vals

    def _argmax(self, row: np.ndarray, state: "GrammarState | None") -> int | None:
        """The best token the grammar allows: the argmax where allowed, else the engine's own search
        (``best_allowed``: each engine knows what its masks cost); None where the grammar, the bias and the bans
        together allow nothing."""
        best = int(row.argmax())
        if not np.isfinite(row[best]):
            return None
        if state is None or state.allowed([best])[0]:
            return best
        return state.best_allowed(row)

    # -- after the step --------------------------------------------------------

    def commit(self, token_ids: Sequence[int]) -> None:
        """Advance the grammar by this step's committed tokens (each was allowed where it stands); a lazy grammar
        wakes at its trigger."""
        if self.grammar is None and self._lazy is None:
            return
        for tok in token_ids:
            self.grammar, self._waiting = self._next(self.grammar, self._waiting, tok)

    def learn(self, output_ids: Sequence[int]) -> int:
        """A finished answer teaches the grammar source how this model spells the text the grammar forced
        (``GrammarState.learn``); how many spellings differed from the tokenizer's."""
        return self._origin.learn(output_ids) if self._origin is not None else 0

    # -- the grammar's progress along tokens ---------------------------------------------------------------------

    def _start(self) -> "tuple[GrammarState | None, bytes]":
        """A copy of the committed grammar state (None: no grammar, or a lazy one still waiting) and the text a
        waiting one has seen."""
        return (self.grammar.copy() if self.grammar is not None else None), self._waiting

    def _next(self, state: "GrammarState | None", waiting: bytes, tok: int) -> "tuple[GrammarState | None, bytes]":
        """The grammar's progress after ``tok``: the state advanced, or a lazy grammar's text grown, and its state
        from the trigger on where ``tok`` completed one."""
        if state is not None:
            state.accept(tok)
            return state, waiting
        if self._lazy is None:
            return None, waiting
        return self._lazy.after(waiting, tok)


class _Lazy:
    """A lazy grammar's trigger watch: the output's text until one of the trigger words appears, then the grammar
    from there (llama.cpp's ``grammar_lazy``: the token that completes the trigger is free; the grammar is fed the
    text from the trigger's start, and constrains every token after)."""

    def __init__(self, grammar: "GrammarState", triggers: Sequence[str], token_bytes: Callable[[int], bytes] | None) -> None:
        if token_bytes is None or not grammar.traits.lazy:
            raise InvalidParameterError("a lazy grammar (grammar_triggers) needs a grammar engine that takes its "
                                        f"trigger's text, and this grammar runs on {grammar.engine}'s, which takes "
                                        "tokens only: send it without triggers")
        self.grammar = grammar  # the start state, copied at each wake
        self.triggers = [t.encode() for t in triggers]
        self.longest = max(len(t) for t in self.triggers)
        self.token_bytes = token_bytes

    def after(self, waiting: bytes, tok: int) -> "tuple[GrammarState | None, bytes]":
        piece = self.token_bytes(tok)
        text = waiting + piece
        start = max(0, len(waiting) - self.longest + 1)  # a trigger ends in the new piece, or was seen before
        hits = [i for i in (text.find(t, start) for t in self.triggers) if i >= 0]
        if not hits:
            return None, text
        state = self.grammar.copy()
        state.feed(text[min(hits):])  # text the grammar does not allow leaves a state that allows nothing
        return state, b""


def dead_end_message(n_output: int) -> str:
    """What a generation that stopped with reason "constraint" says: nothing the model could write was allowed."""
    return (f"the constraints allow no token after {n_output} tokens of output (the grammar or JSON schema, with "
            "logit_bias, ignore_eos or min_tokens banning what it leaves), so the generation cannot go on; loosen "
            "them so that some token stays allowed")


def for_target(constraints: Constraints, n_vocab: int, eog_ids: frozenset[int], stop_ids: frozenset[int],
               grammar_factory: Callable[[str], "GrammarState"] | None,
               token_bytes: Callable[[int], bytes] | None = None) -> ConstraintState | None:
    """The state a generation starts with, or None when its constraints change nothing."""
    if not constraints.active:
        return None
    grammar = None
    if constraints.grammar is not None:
        if grammar_factory is None:
            raise InvalidParameterError("this target cannot enforce a grammar")
        grammar = grammar_factory(constraints.grammar)
    return ConstraintState(constraints, n_vocab, eog_ids, stop_ids, grammar, token_bytes)
