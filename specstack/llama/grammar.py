"""GBNF grammars over a model's vocabulary: which tokens a grammar allows next (JSON schemas become grammars in
``schema_gbnf``).

Grammars are llama.cpp's GBNF (what ``llama-server`` takes for ``grammar``, ``json_schema`` and
``response_format``), parsed by llama.cpp first, so what is accepted and refused is llama.cpp's; the parse state
then runs on llguidance (``guidance.GuidedGrammar``), or on llama.cpp's own grammar sampler (``Grammar``) where
llguidance cannot read the text: ``choose_engine`` is the one place that decides.  Either state is a
``grammar_engine.GrammarState`` and answers the same questions: ``allowed`` about a few candidate ids (what the
greedy path needs: the constrained argmax is almost always among the top logits), ``mask`` about the whole
vocabulary (what sampling needs), ``accept`` and ``walk`` advance it, ``forced`` says which tokens it forces next
(the grammar draft source), and ``copy`` forks it, so a draft can be walked without touching the committed state;
what only one engine does is a trait of the state (``traits``).  ``GrammarCache`` is a vocabulary's
``grammar_engine.GrammarEngine``: the states built once, on one thread.
"""

from __future__ import annotations

import ctypes
import os
import queue
import re
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import InvalidParameterError
from ..gbnf import check_gbnf
from . import guidance
from .backend import llama_cpp_module
from .grammar_engine import GrammarState, GrammarTraits

# llama_token_data as numpy sees it: id (int32), logit (float), p (float), 12 bytes, no padding.
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
# Greedy rows on llama.cpp's sampler: the best logits checked against the grammar before the whole vocabulary is.
TOP_FIRST = (16, 256)


BUILDER_STACK = 256 << 20  # the builder thread's stack: llama.cpp's parser and grammar setup recurse
CACHED = 32  # start states kept per vocabulary (a role's tools and schemas come back request after request)
MASK_BUDGET_S = 1.0  # a start state's estimated whole-vocabulary check, at most (a JSON grammar on Gemma 3: 0.04 s)
SAMPLE_IDS = 4096  # token ids timed to estimate it
_PARSE_ERROR = re.compile(r"error parsing grammar: (.*)")


class Grammar:
    """One GBNF grammar's parse state over one model's vocabulary (llama.cpp's grammar sampler), for the grammars
    llguidance cannot read (``GuidedGrammar`` runs the rest).

    Made only by ``GrammarCache`` (checked with ``gbnf.check_gbnf``, built on the builder thread by
    ``_init_sampler``) and by ``copy``; ``sampler`` is the llama.cpp sampler it owns and frees."""

    def __init__(self, vocab: Any, gbnf: str, n_vocab: int, sampler: Any) -> None:
        self._lc = llama_cpp_module()
        self._vocab = vocab
        self.gbnf = gbnf
        self.n_vocab = n_vocab
        self._smpl = sampler
        self._cands: np.ndarray | None = None

    engine = "llama.cpp"
    # llama.cpp's sampler takes tokens, not a lazy grammar's trigger text; it cannot say what it forces short of a
    # whole-vocabulary check a token, so it neither forces nor learns spellings
    traits = GrammarTraits(lazy=False, forces=False, learns=False)

    def copy(self) -> "Grammar":
        """An independent copy of this parse state (a draft is walked on a copy)."""
        return Grammar(self._vocab, self.gbnf, self.n_vocab, self._lc.llama_sampler_clone(self._smpl))

    def allowed(self, token_ids: Sequence[int]) -> list[bool]:
        """Whether each of ``token_ids`` may come next (an end-of-generation token only where the grammar
        can end)."""
        n = len(token_ids)
        if n == 0:
            return []
        data = np.zeros(n, dtype=_TOKEN_DATA)
        data["id"] = token_ids
        self._apply(data)
        return (data["logit"] != -np.inf).tolist()

    def mask(self) -> np.ndarray:
        """A [n_vocab] bool array: which tokens the grammar allows next."""
        if self._cands is None:
            self._cands = np.zeros(self.n_vocab, dtype=_TOKEN_DATA)
        data = self._cands
        data["id"] = np.arange(self.n_vocab, dtype=np.int32)
        data["logit"] = 0.0
        self._apply(data)
        return data["logit"] != -np.inf

    def best_allowed(self, row: np.ndarray) -> int | None:
        """The allowed token of ``row``'s highest finite logit, ties to the lower id (as ``argmax``); None where
        none is.  A whole-vocabulary check on this sampler costs 43-55 ms over Gemma 3's 262,144 tokens, so the
        best few logits are asked first (``TOP_FIRST``), then the whole vocabulary."""
        for n in TOP_FIRST:
            if n >= len(row):
                break
            top = np.flatnonzero(row >= np.partition(row, len(row) - n)[len(row) - n])  # the n best, ties and all
            if len(top) > 4 * n:
                continue  # a wide tie at the n-th best: the next size, or the whole vocabulary
            top = top[np.lexsort((top, -row[top]))]  # best first; ties by id, as argmax breaks them
            for tok, ok in zip(top.tolist(), self.allowed(top.tolist())):
                if ok and np.isfinite(row[tok]):
                    return int(tok)
        masked = np.where(self.mask(), row, -np.inf)
        best = int(masked.argmax())
        return best if np.isfinite(masked[best]) else None

    def accept(self, token_id: int) -> None:
        """Advance by one token, which must be allowed (llama.cpp aborts on a refused one, so it is checked)."""
        if not self.allowed([token_id])[0]:
            raise ValueError(f"token {token_id} is not allowed by the grammar here")
        self._lc.llama_sampler_accept(self._smpl, int(token_id))

    def walk(self, token_ids: Sequence[int]) -> int:
        """Advance along ``token_ids`` as far as the grammar allows them; how many it took."""
        for i, tok in enumerate(token_ids):
            if not self.allowed([tok])[0]:
                return i
            self._lc.llama_sampler_accept(self._smpl, int(tok))
        return len(token_ids)

    def feed(self, text: bytes) -> bool:
        """Refused: llama.cpp's sampler takes tokens, not text (``traits.lazy`` is False, so a lazy grammar never
        runs on it: ``constraints`` refuses it first)."""
        raise ValueError("llama.cpp's grammar sampler cannot be fed text: a lazy grammar needs llguidance")

    def forced(self) -> list[int]:
        """None proposed: llama.cpp's sampler cannot say what it forces short of a whole-vocabulary check a token."""
        return []

    def learn(self, token_ids: Sequence[int]) -> int:
        """Nothing learnt: this engine proposes no forced text, so it has no spellings to keep."""
        return 0

    error = ""

    def _apply(self, data: np.ndarray) -> None:
        lc = self._lc
        arr = lc.llama_token_data_array(data.ctypes.data_as(ctypes.POINTER(lc.llama_token_data)), len(data), -1, False)
        lc.llama_sampler_apply(self._smpl, ctypes.byref(arr))

    def __del__(self) -> None:
        smpl, self._smpl = getattr(self, "_smpl", None), None
        if smpl:
            self._lc.llama_sampler_free(smpl)


def _init_sampler(lc: Any, vocab: Any, gbnf: str) -> Any:
    """llama.cpp's grammar sampler for ``gbnf``, or an ``InvalidParameterError`` with its parser's reason.

    llama.cpp writes that reason, and the whole grammar after it, straight to the process's stderr; it is caught
    there (fd 2 goes to a file for the call, and whatever else was written meanwhile is passed back on)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            sampler = lc.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        text = caught.read().decode("utf-8", "replace")
    match = _PARSE_ERROR.search(text)
    if match is None and text:
        sys.stderr.write(text)  # not the parser's: someone else's line
    if sampler:
        return sampler
    reason = match.group(1).strip() if match else _log_reason()
    raise InvalidParameterError(f"the grammar does not parse: {reason}" if reason else
                                "the grammar does not parse (llama.cpp's GBNF parser refused it; see its "
                                "docs/grammars)")


def _log_reason() -> str:
    """The grammar error llama.cpp logged (left recursion, an undefined rule), from the log's recent lines."""
    from .backend import recent_log

    for line in reversed(recent_log[-5:]):
        if "grammar" in line:
            return line.strip()
    return ""


def _checked(grammar: Grammar) -> Grammar:
    """``grammar`` if a whole-vocabulary check of its start state is affordable; else an ``InvalidParameterError``.

    llama.cpp keeps a parse stack for every alternative alive at once and checks each token against each, so a
    grammar of thousands of alternatives side by side (a raw GBNF ``a | b | ...``) costs minutes per token, which
    the text's size alone does not show.  A sample of the vocabulary is timed, and the whole extrapolated."""
    n = min(SAMPLE_IDS, grammar.n_vocab)
    ids = np.linspace(0, grammar.n_vocab - 1, n).astype(np.int64).tolist()
    start = time.perf_counter()
    state = grammar.copy()  # a step copies the state twice (the draft's walk, the rows'): as dear as its stacks
    copied = time.perf_counter()
    state.allowed(ids)
    estimate = 2 * (copied - start) + (time.perf_counter() - copied) * grammar.n_vocab / n
    if estimate > MASK_BUDGET_S:
        raise InvalidParameterError(
            f"the grammar would take about {estimate:.0f} s a token to check against this model's "
            f"{grammar.n_vocab:,}-token vocabulary (the limit is {MASK_BUDGET_S:.0f} s): it keeps too many "
            "alternatives alive at once; share their common prefixes (a | ab becomes a (b)?) or send fewer")
    return grammar


class GrammarBuilder:
    """One thread, with a deep stack, that builds every grammar in the process, one at a time.

    Building runs llama.cpp's recursive parser and its first stack expansion: a grammar that passed the limits of
    ``gbnf`` still needs more stack than a server's threads have at the edge of those limits, and a large one
    takes seconds, which must not hold up a role's engine thread (it decodes every other request)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], Any]) -> Future:
        """``fn()`` on the builder thread; its result or exception in the future."""
        future: Future = Future()
        if threading.current_thread() is self._thread:
            _settle(future, fn)
            return future
        self._start()
        self._queue.put((future, fn))
        return future

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            old = threading.stack_size(BUILDER_STACK)
            try:
                self._thread = threading.Thread(target=self._serve, name="specstack-grammar", daemon=True)
                self._thread.start()
            finally:
                threading.stack_size(old)

    def _serve(self) -> None:
        while True:
            future, fn = self._queue.get()
            if future.set_running_or_notify_cancel():
                _settle(future, fn)


def _settle(future: Future, fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except BaseException as exc:  # handed to the caller, who raises it where it asked
        future.set_exception(exc)


BUILDER = GrammarBuilder()


class GrammarCache:
    """A vocabulary's recently built grammars' start states by GBNF text; each use gets its own copy.

    ``prepare`` builds one ahead on the builder thread (a server does this while the request waits, off the
    engine's thread), so ``get`` on the engine thread only copies it (a clone, well under a millisecond).

    llama.cpp parses every grammar first, so what is accepted, refused and said about it is llama.cpp's; the state
    then runs on llguidance (``guidance``: masks in microseconds, forced tokens for drafts), and on llama.cpp's own
    sampler only where llguidance cannot read the text (``choose_engine``; a state's ``engine`` says which)."""

    def __init__(self, vocab: Any, n_vocab: int, eog_ids: frozenset[int] = frozenset()) -> None:
        self._vocab = vocab
        self._n_vocab = n_vocab
        self._eog_ids = eog_ids
        self._tokenizer: Any = None  # llguidance's, built on the first grammar
        self.spellings = guidance.Spellings()  # how the model spelled forced text (``GuidedGrammar.learn``)
        self._built: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()

    def prepare(self, gbnf: str) -> "Future[GrammarState]":
        """The start state of ``gbnf``, built (or being built) on the builder thread."""
        with self._lock:
            future = self._built.get(gbnf)
            if future is not None:  # a refusal too: the same grammar sent again is answered at once, not rebuilt
                self._built.move_to_end(gbnf)
                return future
            try:
                check_gbnf(gbnf)
            except InvalidParameterError as exc:
                future = Future()
                future.set_exception(exc)
                return future
            future = BUILDER.run(lambda: self._build(gbnf))
            self._built[gbnf] = future
            while len(self._built) > CACHED:
                self._built.popitem(last=False)
            return future

    def warm(self) -> "Future[Any]":
        """Build llguidance's tokenizer of this vocabulary now, on the builder thread, so that no request waits for
        it: about 3 s on Gemma 3's 262,144 tokens here (the first constrained request's time to first token went
        from 0.5 s to 3.9 s with it), paid once per vocabulary. A grammar prepared meanwhile queues behind it.
        llguidance's part of the build (1.4 s of the 3) holds the GIL, so a server waits for this before it serves
        (``RoleWorker._load``)."""
        return BUILDER.run(self._ensure_tokenizer)

    def get(self, gbnf: str) -> GrammarState:
        """A fresh copy of ``gbnf``'s start state (built now, on the builder thread, if it was not prepared)."""
        return self.prepare(gbnf).result().copy()

    def _build(self, gbnf: str) -> GrammarState:
        """On the builder thread: ``gbnf``'s start state on the engine that runs it."""
        return choose_engine(self._vocab, self._n_vocab, gbnf, self._ensure_tokenizer, self.spellings)

    def _ensure_tokenizer(self) -> Any:
        """llguidance's tokenizer of the vocabulary, built on first use (on the builder thread: one at a time)."""
        if self._tokenizer is None:
            self._tokenizer = guidance.tokenizer(llama_cpp_module(), self._vocab, self._n_vocab, self._eog_ids)
        return self._tokenizer


def choose_engine(vocab: Any, n_vocab: int, gbnf: str, tokenizer: Callable[[], Any],
                  spellings: guidance.Spellings) -> GrammarState:
    """The start state of ``gbnf``, on the engine that runs it: the one place the engine is chosen.

    llama.cpp parses every grammar first, so its refusal is the answer; llguidance then runs what it can read
    (``tokenizer()``: its view of the vocabulary, built once), and llama.cpp's own sampler the rest (token
    references, ``\\u`` escapes in ranges), where a grammar whose whole-vocabulary check would cost too much is
    refused (``_checked``)."""
    lc = llama_cpp_module()
    sampler = _init_sampler(lc, vocab, gbnf)
    try:
        state = guidance.compile_gbnf(tokenizer(), n_vocab, gbnf, spellings)
    except InvalidParameterError:
        return _checked(Grammar(vocab, gbnf, n_vocab, sampler))
    lc.llama_sampler_free(sampler)
    return state
