"""llguidance as the constraint engine: a grammar's parse state over a llama.cpp vocabulary, in microseconds.

llama.cpp's grammar sampler checks a token by walking its text through every parse stack alive, so a
whole-vocabulary mask costs about 32 ms on Gemma 3's 262,144 tokens; llguidance (Microsoft's Rust library, which
llama.cpp can also build in) computes the same mask from a token trie and a lexer in 0.02-0.1 ms, and says which
bytes and tokens the grammar forces next (``forced``), which the ``grammar`` draft source proposes.

The grammar text is llama.cpp's GBNF, already parsed by llama.cpp (``grammar._init_sampler``) so what is
accepted, refused and said about it stays llama.cpp's; llguidance reads the same text (``grammar_from("gbnf")``).
Two things differ, both on purpose (``docs/constraints.md``): control tokens (``<start_of_turn>``) are never
text a grammar can match, and the mask costs too little to need ``grammar._checked``'s refusal of grammars with
thousands of alternatives side by side.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from ..errors import InvalidParameterError
from .grammar_engine import GrammarTraits

_PIECE = 16 * 1024  # a token's longest text, as llguidance.llamacpp reads them


def tokenizer(lc: Any, vocab: Any, n_vocab: int, eog_ids: Sequence[int]) -> Any:
    """llguidance's tokenizer of a llama.cpp vocabulary: every token's bytes (a control token's marked with a
    leading 0xff, so no grammar text can match it) and llama.cpp's own tokenize.  About 1-2 s for Gemma 3's
    262,144 tokens here, so ``GrammarCache`` builds it once per vocabulary.

    ``llguidance.llamacpp`` also marks user-defined tokens written ``<...>``; here they stay text, as llama.cpp's
    grammar sampler reads them: a tool-call grammar's ``<tool_call>`` is then the model's own ``<tool_call>``
    token, where it has one, as with llama.cpp's engine.  (That module also calls llama.cpp's deprecated attribute
    function, one warning per token.)"""
    import llguidance

    buf = ctypes.create_string_buffer(_PIECE + 1)
    control = lc.LLAMA_TOKEN_ATTR_CONTROL
    tokens: list[bytes] = []
    for tok in range(n_vocab):
        n = lc.llama_token_to_piece(vocab, tok, buf, _PIECE, 0, True)
        piece = buf.raw[:n] if n > 0 else b""
        if lc.llama_vocab_get_attr(vocab, tok) & control:
            piece = b"\xff" + piece
        tokens.append(piece)
    tokenize = ctypes.cast(lc.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    return llguidance.LLTokenizer.from_llamacpp(tokens=tokens, vocab_ptr=vocab, tokenize_fptr=tokenize,
                                                eos_token=sorted(eog_ids) or [0])


_HEADER = "%llguidance {}"
# ``allowed`` asks llguidance token by token (``validate_tokens``) up to this many tokens before it computes the
# state's whole mask: one token ~1 us, the mask 0.04-0.5 ms over Gemma 3's 262,144 tokens.
ASK_ALONE = 8
_NO_FORCING = '%llguidance {"no_forcing": true}'


def compile_gbnf(tok: Any, n_vocab: int, gbnf: str, spellings: "Spellings") -> "GuidedGrammar":
    """The start state of ``gbnf`` over ``tok``'s vocabulary; ``InvalidParameterError`` where llguidance cannot read
    it (``grammar.choose_engine`` then runs it on llama.cpp's sampler)."""
    return GuidedGrammar(_matcher(tok, gbnf), tok, n_vocab, gbnf, spellings)


def _matcher(tok: Any, gbnf: str) -> Any:
    """llguidance's matcher (``LLMatcher``) at the start of ``gbnf``."""
    import llguidance

    try:
        grammar = llguidance.grammar_from("gbnf", gbnf)
    except Exception as exc:  # its GBNF reader raises its own error types on what it cannot convert
        raise InvalidParameterError(f"llguidance cannot read the grammar: {exc}") from None
    if not grammar.startswith(_HEADER):
        raise InvalidParameterError("llguidance cannot read the grammar: its GBNF reader wrote no options header")
    # Every token whose text the grammar allows, as llama.cpp's sampler: by default llguidance allows only the
    # canonical token where the grammar forces text ("name" after '{"', never "n"), which would change the output.
    grammar = _NO_FORCING + grammar[len(_HEADER):]
    matcher = llguidance.LLMatcher(tok, grammar, log_level=0, limits=_limits())
    if matcher.is_error():
        raise InvalidParameterError(f"llguidance cannot read the grammar: {matcher.get_error()}")
    return matcher


def _limits() -> Any:
    """llguidance's resource limits, widened to what ``gbnf.check_gbnf`` already admits: a rule of thousands of
    alternatives (an enum written out) is a row of thousands of items, over its default 2,000, and a step may then
    visit that many per token.  Errors leave the grammar out of their text (it can be 256 KiB)."""
    import llguidance

    return llguidance.LLParserLimits(max_items_in_row=MAX_ROW_ITEMS, step_max_items=STEP_ITEMS, verbose_errors=False)


MAX_ROW_ITEMS = 50_000
STEP_ITEMS = 500_000  # about 25 ms of one mask at its quoted 20k items/ms, the worst a step may cost


class Spellings:
    """How a model spelled text a grammar forced, where it did otherwise than its tokenizer: forced bytes -> the
    model's tokens for (a prefix of) them, the most recently seen ``SPELLINGS`` kept. One per vocabulary
    (``grammar.GrammarCache``), learnt from finished answers (``GuidedGrammar.learn``), read by ``forced``.

    A model does not always write forced text canonically: Gemma 3 270M, constrained to a JSON schema, writes
    ``d`` ``ue`` ``_`` ``day`` ``s`` where its tokenizer says ``due`` ``_`` ``days``, and writes it so again the
    next time, so the canonical draft fails at its first token on every request with that schema.

    Beside the spellings, each grammar's last finished answer (its text and tokens: how the model spaces and splits
    the text around what the grammar forces, ``GuidedGrammar._spaced`` and ``_tokenized``), and a cache of short
    texts' tokenizations."""

    def __init__(self) -> None:
        self._seen: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        # Per grammar (its GBNF text), the last finished answer's text: how the model spaces it, before the answer at
        # hand has written the byte in question (``GuidedGrammar._spaced``).
        self._answers: OrderedDict[str, tuple[bytes, frozenset[int]]] = OrderedDict()
        # Bytes -> token ids as the tokenizer splits them, for walking the grammar past spacing (``_consume``): a
        # call into llama.cpp's tokenizer cost ~30 us, most of ``forced``'s time; the texts repeat (keys, spaces).
        self._ids: dict[bytes, list[int]] = {}

    def ids(self, tok: Any, data: bytes) -> list[int]:
        got = self._ids.get(data)
        if got is None:
            if len(self._ids) >= SPELLINGS:
                self._ids.clear()
            got = self._ids[data] = list(tok.tokenize_bytes(data))
        return got

    def answer(self, gbnf: str) -> tuple[bytes, frozenset[int]]:
        """The grammar's last finished answer: its text, and the tokens it was written in."""
        return self._answers.get(gbnf, (b"", frozenset()))

    def put_answer(self, gbnf: str, text: bytes, ids: Sequence[int]) -> None:
        self._answers[gbnf] = (text[-SPACING_TEXT:], frozenset(ids))
        self._answers.move_to_end(gbnf)
        while len(self._answers) > ANSWERS:
            self._answers.popitem(last=False)

    def get(self, forced: bytes) -> tuple[int, ...] | None:
        return self._seen.get(forced)

    def put(self, forced: bytes, tokens: tuple[int, ...] | None) -> None:
        """Remember ``tokens`` for ``forced`` (None: the model spelled it canonically; forget any other spelling)."""
        if tokens is None:
            self._seen.pop(forced, None)
            return
        self._seen[forced] = tokens
        self._seen.move_to_end(forced)
        while len(self._seen) > SPELLINGS:
            self._seen.popitem(last=False)

    def clear(self) -> None:
        self._seen.clear()
        self._answers.clear()

    def __len__(self) -> int:
        return len(self._seen)


SPELLINGS = 4096
SPACING_RUNS = 6  # optional-whitespace points one forced draft may cross (``GuidedGrammar._spaced``)
SPACING_IDS = 512  # an answer's last tokens kept as evidence of how it spaces and splits the text around what is forced
SPACING_TEXT = 2048  # a finished answer's last bytes kept for the grammar's next answer (``Spellings.put_answer``)
ANSWERS = 64  # grammars whose last answer's spacing is kept


def _spacing(text: bytes, prev: bytes, nxt: bytes) -> bytes | None:
    """Whether ``text`` puts a space between the byte ``prev`` and the forced byte ``nxt`` (b" ") or not (b""): as it
    did the last time it wrote the two; where it never did, what followed ``prev`` the last time ``text`` has it
    (before its last byte). None for no such byte, or other whitespace (newlines and indents are not guessed).
    The pair first: a quote closes a key (``"name":``) and a value (``"ab" }`` where Gemma ends an object)."""
    if prev and nxt:
        spaced, bare = text.rfind(prev + b" " + nxt), text.rfind(prev + nxt)
        if spaced >= 0 or bare >= 0:
            return b" " if spaced > bare else b""
    i = text.rfind(prev, 0, len(text) - 1) if prev else -1
    if i < 0:
        return None
    after = text[i + 1:i + 3]
    if after[:1] in (b" ", b"\t", b"\n", b"\r"):
        return b" " if after[:1] == b" " and after[1:2] not in (b" ", b"\t", b"\n", b"\r") else None
    return b""


def _consume(matcher: Any, ids: list[int]) -> bool:
    """Advance ``matcher`` by ``ids`` (some bytes as the tokenizer splits them: the grammar reads bytes); whether it
    took them all."""
    return matcher.try_consume_tokens(ids) == len(ids)


class GuidedGrammar:
    """One grammar's parse state on llguidance (a ``grammar_engine.GrammarState``): beyond what ``grammar.Grammar``
    answers, it takes text (``feed``: a lazy grammar's trigger), says which tokens the grammar forces next
    (``forced``) and learns how the model spells them (``learn``).  The mask is computed once per state and read by
    every ask."""

    engine = "llguidance"
    traits = GrammarTraits(lazy=True, forces=True, learns=True)

    def __init__(self, matcher: Any, tokenizer: Any, n_vocab: int, gbnf: str,
                 spellings: Spellings | None = None) -> None:
        self._m = matcher
        self._tok = tokenizer
        self.n_vocab = n_vocab
        self.gbnf = gbnf
        self.spellings = spellings if spellings is not None else Spellings()
        self._bits: np.ndarray | None = None
        self._dead = False  # fed text it does not allow (``feed``): nothing is allowed
        # The answer's last ``SPACING_IDS`` tokens: how it splits forced text (``_tokenized``) and, decoded only when a
        # draft asks, how it spaces it (``_spaced``). A verification row advances a copy of the state per token, so
        # this is all that row pays.
        self._ids: tuple[int, ...] = ()

    def copy(self) -> "GuidedGrammar":
        """An independent copy of this parse state (a draft is walked on a copy)."""
        twin = GuidedGrammar(self._m.deep_copy(), self._tok, self.n_vocab, self.gbnf, self.spellings)
        twin._bits = self._bits  # the same state allows the same tokens (arrays are never written in place)
        twin._dead = self._dead
        twin._ids = self._ids
        return twin

    def allowed(self, token_ids: Sequence[int]) -> list[bool]:
        """Whether each of ``token_ids`` may come next (an end-of-generation token only where the grammar can end)."""
        if len(token_ids) == 0:
            return []
        if self._bits is None and len(token_ids) <= ASK_ALONE and not self._dead and not self._m.is_stopped():
            # a greedy row asks about its argmax: ~1 us a token, where the whole mask costs ~0.5 ms (Gemma 3)
            return [0 <= t < self.n_vocab and self._m.validate_tokens([int(t)]) == 1 for t in token_ids]
        ids = np.asarray(token_ids, dtype=np.int64)
        bits = self._mask_bits()
        inside = (ids >= 0) & (ids < self.n_vocab)
        safe = np.where(inside, ids, 0)
        return (inside & ((bits[safe >> 5] >> (safe & 31).astype(np.uint32)) & 1).astype(bool)).tolist()

    def mask(self) -> np.ndarray:
        """A [n_vocab] bool array: which tokens the grammar allows next."""
        bits = self._mask_bits()
        return np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.n_vocab].astype(bool)

    def best_allowed(self, row: np.ndarray) -> int | None:
        """The allowed token of ``row``'s highest finite logit, ties to the lower id (as ``argmax``); None where
        none is.  Read off the state's mask, computed once (0.04-0.5 ms over Gemma 3's 262,144 tokens): asking the
        best 16 and 256 logits first, as on llama.cpp's sampler, cost an ``argpartition`` of 2.8 ms each."""
        ids = np.flatnonzero(self.mask())
        if len(ids) == 0:
            return None
        vals = row[ids]
        i = int(vals.argmax())  # the first of equal maxima: the lowest id
        return int(ids[i]) if np.isfinite(vals[i]) else None

    def accept(self, token_id: int) -> None:
        """Advance by one token, which must be allowed."""
        if self._dead or not self._m.consume_token(int(token_id)):  # no mask needed: consuming says it
            raise ValueError(f"token {token_id} is not allowed by the grammar here")
        self._bits = None
        self._wrote([int(token_id)])

    def walk(self, token_ids: Sequence[int]) -> int:
        """Advance along ``token_ids`` as far as the grammar allows them; how many it took."""
        if len(token_ids) == 0 or self._dead:
            return 0
        ids = [int(t) for t in token_ids]
        n = self._m.try_consume_tokens(ids)  # stops at a refused token, no error state
        self._bits = None
        if n:
            self._wrote(ids[:n])
        return n

    def feed(self, text: bytes) -> bool:
        """Advance by ``text`` (whole tokens' bytes: a lazy grammar's trigger and what followed it in the same
        tokens); where the grammar does not allow it, the state allows nothing from then on.  Whether it did."""
        ids = list(self._tok.tokenize_bytes(text)) if text else []
        if self.walk(ids) == len(ids):  # (``walk`` notes the text)
            return True
        self._dead = True
        return False

    def forced(self) -> list[int]:
        """The tokens every continuation the grammar allows starts with, and past them what it forces after optional
        whitespace spaced as this answer spaces it (``_spaced``): the forced bytes as the model spelled them last
        time, where it spelled them otherwise than its tokenizer (``Spellings``), else tokenized as the tokenizer
        would, stopping before a token that the bytes after them could still merge into."""
        if self._dead or self._m.is_stopped():
            return []
        forced = self._m.compute_ff_bytes()
        seen = self.spellings.get(forced) if forced else None
        spaced = self._spaced(forced)
        if seen is None:
            return self._tokenized(forced + spaced)
        spelled = self._tok.decode_bytes(list(seen))  # the model's spelling of (a prefix of) the forced bytes
        tail = forced[len(spelled):] + spaced if forced.startswith(spelled) else b""
        return list(seen) + self._tokenized(tail)

    def _tokenized(self, data: bytes) -> list[int]:
        """``data`` as the tokenizer splits it, stopping before a last token that the bytes after it could still merge
        into, unless the model has written that token, alone, in this answer or the grammar's last one: Gemma writes
        ``":`` ``_"`` ``Northwind`` (``_`` a space), so after a key the draft carries the value's opening quote, which
        the tokenizer alone would leave off (``_"N`` could follow)."""
        if not data:
            return []
        ids, rest = self._tok.tokenize_partial(data)
        ids = list(ids)
        if rest:
            last = self.spellings.ids(self._tok, rest)
            if len(last) == 1 and (last[0] in self._ids or last[0] in self.spellings.answer(self.gbnf)[1]):
                ids.append(last[0])
        return ids

    def _spaced(self, head: bytes) -> bytes:
        """After the forced bytes ``head``: where the grammar next allows optional whitespace before text it then
        forces, that text, spaced as this answer spaced the same two bytes the last time it wrote them (``_spacing``),
        and so on for up to ``SPACING_RUNS`` such points.

        llama.cpp's JSON converter puts an optional space after every ``{``, ``:`` and ``,`` and after each key, so
        the forced runs alone are a key's name and a closing quote, too short to pay for a verification's rows where
        rows are dear (on Gemma 3 270M the cost policy drafted none of them on a 3-key extraction). A model keeps its
        spacing within an answer (Gemma writes ``{ "city": "Paris", "country": ...``), so after ``, "country`` the
        draft is ``country": "`` rather than ``country``. It is a guess like any draft, verified like any draft: a
        model that spaces otherwise refuses it, and the cost policy calibrates the grammar's scores on outcomes.
        Only a single space or none is guessed (never newlines and indents): from this answer's text, or where it has
        not yet written the bytes, from the last answer to the same grammar (``Spellings.answer``), so an agent's
        next call to the same tool drafts its first key whole."""
        text = last = b""
        matcher = self._m
        if head:
            matcher = matcher.deep_copy()
            if not _consume(matcher, self.spellings.ids(self._tok, head)):
                return b""
        out = b""
        for _ in range(SPACING_RUNS):
            probe = matcher.deep_copy()
            if not _consume(probe, self.spellings.ids(self._tok, b" ")):
                break
            if not text:  # decoded only where optional whitespace follows (a grammar without any pays nothing)
                text, last = self._tok.decode_bytes(list(self._ids)), self.spellings.answer(self.gbnf)[0]
            after = probe.compute_ff_bytes()
            prev = (text + head + out)[-1:]
            space = _spacing(text, prev, after[:1])
            if space is None:
                space = _spacing(last, prev, after[:1])
            if space is None:
                break
            if space:  # the space, even where nothing is forced after it (a number's digits)
                matcher, out = probe, out + space
            elif after:  # the answer writes no space here: the same text, without it
                probe = matcher.deep_copy()
            if not after or not _consume(probe, self.spellings.ids(self._tok, after)):
                break
            matcher, out = probe, out + after
        return out

    def _wrote(self, ids: list[int]) -> None:
        self._ids = (self._ids + tuple(ids))[-SPACING_IDS:]

    def learn(self, token_ids: Sequence[int]) -> int:
        """From this state on, walk an answer (``token_ids``, on a copy) and remember, at every position where the
        grammar forced text, how the answer spelled it (``Spellings``), and its text, as how the model spaces this
        grammar's answers (``_spaced``); how many spellings differed from the tokenizer's. About 5 us a token (0.7 ms
        for a 160-token JSON answer on Gemma 3), once, when an answer is finished."""
        if self._dead:
            return 0
        m = self._m.deep_copy()
        ids = [int(t) for t in token_ids]
        pieces = [self._tok.decode_bytes([t]) for t in ids]
        self.spellings.put_answer(self.gbnf, b"".join(pieces), ids)
        learnt = 0
        for i, tok in enumerate(ids):
            if m.is_stopped():
                break
            forced = m.compute_ff_bytes()
            if forced:
                run, spelled = [], b""
                for j in range(i, len(ids)):
                    if not pieces[j] or not forced.startswith(spelled + pieces[j]):
                        break
                    spelled += pieces[j]
                    run.append(ids[j])
                canonical = list(self._tok.tokenize_partial(forced)[0])
                n = min(len(run), len(canonical))  # the tokenizer stops before a token later bytes could merge into
                if run and run[:n] != canonical[:n]:
                    self.spellings.put(forced, tuple(run))
                    learnt += 1
                elif run:
                    self.spellings.put(forced, None)
            if not m.consume_token(tok):
                break
        return learnt

    @property
    def error(self) -> str:
        """llguidance's reason where it gave up on this state (a resource limit), "" otherwise."""
        return self._m.get_error().strip().splitlines()[0] if self._m.is_error() else ""

    def _mask_bits(self) -> np.ndarray:
        if self._dead:
            return np.zeros((self.n_vocab + 31) // 32, dtype=np.uint32)
        if self._bits is None:
            bits = np.zeros((self.n_vocab + 31) // 32, dtype=np.uint32)
            self._m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            self._bits = bits
        return self._bits
