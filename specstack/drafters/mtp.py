"""MTP: drafts from the target's own multi-token-prediction (NextN) head, as llama.cpp's ``--spec-type draft-mtp``.

Models such as Qwen3.5/3.6, Qwen3-Next, DeepSeek V3/V4, GLM-4.x/5 and MiMo ship NextN layers: a trained head
that, given the token at position p and the target's hidden row at p-1, predicts the token at p+1. It needs no
second model and no matching vocabulary. One MTP context (``llama.mtp.MtpContext``, over the target's loaded
weights) serves every generation, one sequence per slot, and a step's generations are drafted in one call per
draft position. With one head, k > 1 chains the head on its own output row, as llama.cpp does. With chained heads
(step35: one trained head per draft position), draft position i runs head i on the whole prefix from the last
committed token (its own KV: the draft rows of head i-1 are no use to it), and every head catches up on the
target's pairs, as llama.cpp's ``chain_heads`` driver does; a draft is then at most as long as there are heads.

The head conditions on the target: it declares ``needs_hidden``, and the engine hands it the target's hidden
rows (``types.HiddenRows``) of every token the target kept: the prompt's at ``begin``, each verification's
accepted rows at ``advance`` (rows of rejected drafts never arrive). The MTP cache holds, at each position p of
the context, the pair (x_p, h_{p-1}); the last committed token's pair uses the row the target sampled it from
(llama.cpp's ``pending_h``). Pairs are caught up lazily, in the draft's first call (llama.cpp spends one more
call per step, before acceptance is known, and re-evaluates rejected rows); after a long plain run, only the last
``CATCH_UP`` of them, in a cache started afresh.

Gemma4's head is a separate GGUF, the assistant (``-md ASSISTANT.gguf``), whose attention reads the target's own KV
cache (``llama.mtp.MtpContext``'s shared mode). As llama.cpp's ``is_mem_shared`` path does, it keeps no pairs, so
nothing is caught up: a draft feeds the last committed token with the target's row before it, then each drafted
token with the head's own output row, every row at the same position (the last committed token's: the target's
KV holds everything before it, and the assistant was trained to draft so).

Example: context ``[a, b, c]`` with the target's rows h_a, h_b in the cache store. A draft runs one call on
(c at 2, h_b) -> d0 and the head's row g0, then (d0 at 3, g0) -> d1. The target accepts d0 and emits t: the
engine hands rows for positions 2..3 (h_c, h_d0). The next draft drops the chained row at 3, and catches up
(d0 at 3, h_c) with (t at 4, h_d0) -> the next draft, in one call.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..errors import UnsupportedModelError
from ..llama.mtp import MtpRow
from ..llama.target import MtpTarget
from ..sampling import sample, softmax
from ..types import Draft, HiddenRows
from .base import (Asked, BuildContext, DraftChain, Drafter, ModelDraftConfig, DraftRequest, LlamaCpp, Needs,
                   config_from_options, register)

if TYPE_CHECKING:
    from ..modelfile.meta import GGUFInfo


# Pairs a draft's first call takes on. Plain steps cost the head nothing: it used to catch up every 8 plain steps
# whether or not a draft was ever asked for again, so `mtp@cost` paid for a head it had stopped using. After a longer
# plain run the head's cache starts afresh on the last CATCH_UP positions (``_behind``), for a probe and a draft
# alike: a full catch-up (about 2 ms for 50 pairs on the bundled MTP model, two plain steps) fell on the first draft
# after every probe that drafted well, a spike paid whether or not that draft was accepted. The head reads the
# target's row at every position, which carries the context: on the 8 third-party completions of the bench
# (pycoder-6m-mtp, fixed k 1 and 3), a head whose cache held only the prompt's last 8 positions drafted as well as
# one that held the whole prompt (331/425 against 331/424 tokens accepted at k 1, 446/926 against 446/925 at k 3).
CATCH_UP = 8

NAME = "mtp"  # its registry name, which a model's note names (``note_mtp``, ``loading.settle_drafts``)


class HeadSlots:
    """What the drafters over a head context (``mtp``, ``eagle3``, ``dflash``) do alike with their per-slot records
    (each with ``tokens``, ``n_kv``: the head's cache holds correct pairs to there, and ``dirty``: chained draft rows
    sit past it): clean the draft rows away, find a slot whose record holds a prompt's prefix, take it over, end,
    and pick a draft token from a logged row."""

    head: Any  # the head's context: truncate, reset, copy by sequence
    _seqs: dict[int, Any]
    config: Any  # the drafter's config: ``p_min``
    n_vocab: int
    temperature: float
    _sampled: bool
    _rng: np.random.Generator

    def _pick(self, logits: np.ndarray, need_conf: bool) -> tuple[int, float, np.ndarray | None]:
        """(token, confidence, q row or None): the argmax at temperature 0, else a sample from q, the softmax of the
        logged row at the draft's temperature (ids outside a head's reduced vocabulary are ``-inf``: q = 0 there),
        which rejection sampling then corrects to the target's distribution. A DFlash block draws each slot from
        its own row, which does not depend on the tokens drawn before it, so that q is the slot's."""
        logits = logits[: self.n_vocab]
        if not self._sampled:
            tok = int(logits.argmax())
            if self.config.p_min <= 0.0 and not need_conf:
                return tok, 1.0, None
            return tok, float(1.0 / np.exp(logits.astype(np.float64) - logits[tok]).sum()), None
        q = softmax(logits[None, :], self.temperature)[0]
        tok = sample(q, self._rng)
        return tok, float(q[tok]), q

    def _clean(self, seq: int, st: Any) -> None:
        """Cut the last draft's chained rows: their pairs used the head's own rows, not the target's."""
        if st.dirty:
            self.head.truncate(seq, st.n_kv)
            st.dirty = False

    def _holder(self, seq: int, prompt: list[int], start: int, held: Callable[[Any], int]) -> tuple[int, Any] | None:
        """The slot whose record holds ``prompt``'s first ``start`` positions (``held``: how many rows it has), this
        slot's own first, then another's (the head's cache is unified, so it can be copied); None where none does."""
        own = self._seqs.get(seq)
        order = ([(seq, own)] if own is not None else []) + [(s, o) for s, o in self._seqs.items() if s != seq]
        return next(((s, o) for s, o in order if held(o) >= start and o.tokens[:start] == prompt[:start]), None)

    def _take_over(self, seq: int, src: int, keep: int, fresh: Any) -> Any:
        """``fresh`` as ``seq``'s record, the head's cache holding ``src``'s first ``keep`` pairs for it."""
        if src == seq:
            self.head.truncate(seq, keep)
        else:
            self.head.copy(src, seq, keep)
        self._seqs[seq] = fresh
        return fresh

    def end(self, seq: int = 0, complete: bool = True) -> None:
        st = self._seqs.get(seq)
        if st is None:
            return
        self._clean(seq, st)
        if not complete:  # a cancelled generation's slot is reset by the engine: nothing there to reuse
            self.head.reset(seq)
            del self._seqs[seq]


@dataclass(frozen=True)
class MtpConfig(ModelDraftConfig):
    """The head's sampling: ``draft_temp``, ``p_min`` and ``seed``, as a draft model's; ``draft_model`` (-md): the
    assistant GGUF of a family whose head ships apart from the target (gemma4), unused by the others."""

    draft_model: Path | None = None


@dataclass
class _Seq:
    """What the MTP context and the row store hold for one sequence (slot); kept after ``end`` for prefix reuse."""

    tokens: list[int] = field(default_factory=list)  # the context: prompt, then committed tokens
    h: np.ndarray | None = None  # the target's rows by position (zeros where none was handed over)
    n_h: int = 0  # rows known for positions [0, n_h)
    n_kv: int = 0  # the MTP cache holds correct pairs for positions [0, n_kv) (or [start, n_kv), see begin)
    dirty: bool = False  # chained draft rows sit at positions >= n_kv
    window: bool = False  # the cache was started afresh at n_kv after a plain run (``_behind``): nothing before it

    def put(self, rows: HiddenRows) -> None:
        """Store ``rows`` and forget any past them (they belonged to tokens that were cut)."""
        need = rows.end
        if self.h is None or self.h.shape[0] < need:
            grown = np.zeros((max(need, 2 * (0 if self.h is None else self.h.shape[0]), 64), rows.rows.shape[1]), np.float32)
            if self.h is not None:
                grown[: self.n_h] = self.h[: self.n_h]
            self.h = grown
        if rows.start > self.n_h:
            self.h[self.n_h : rows.start] = 0.0
        self.h[rows.start : need] = rows.rows
        self.n_h = need

    def before(self, start: int, end: int, width: int) -> np.ndarray:
        """The rows h_{p-1} for positions p in [start, end): zeros at position 0 and where none is known."""
        out = np.zeros((end - start, width), np.float32)
        lo, hi = max(start - 1, 0), min(end - 1, self.n_h)
        if self.h is not None and hi > lo:
            out[lo - (start - 1) : hi - (start - 1)] = self.h[lo:hi]
        return out


@dataclass(frozen=True)
class _Saved:
    """A sequence's head state for the host prompt cache (``MtpDrafter.save_prefix``)."""

    tokens: list[int]
    h: np.ndarray  # the target's rows at positions [0, len(tokens))
    n_kv: int  # pairs the head's cache holds
    kv: bytes  # the head's cache (llama.cpp's per-sequence state)


class MtpDrafter(HeadSlots):
    """Drafts from the target's NextN head (see the module docstring)."""

    name = NAME
    needs_hidden = True

    def __init__(self, target: MtpTarget, temperature: float, config: MtpConfig) -> None:
        self.config = config
        self.head = target.open_mtp(config.draft_model) if config.draft_model is not None else target.open_mtp()
        target.want_hidden()
        self.n_embd = self.head.n_embd
        self.n_vocab = target.n_vocab
        self.temperature = config.draft_temp if config.draft_temp is not None else temperature
        self._sampled = temperature > 0.0 and self.temperature > 0.0
        self._rng = np.random.default_rng(None if config.seed is None or config.seed < 0 else config.seed + 2)
        self._seqs: dict[int, _Seq] = {}
        self._warm_up()

    def _warm_up(self) -> None:
        """One throw-away call, as for draft models: a context's first call allocates its graph, a spike the cost
        policy would otherwise charge to the first draft."""
        for n in (2, 1, 3):  # a step's first call (catch-up rows + the draft row), then the chained one-row calls
            self.head.run([MtpRow(0, 0, [0] * n, np.zeros((n, self.n_embd), np.float32), output=True)])
            self.head.reset(0)
        for head in range(1, self.head.n_heads):  # chained heads: each head's graph (its own weights) once
            self.head.run([MtpRow(0, 0, [0] * (head + 2), np.zeros((head + 2, self.n_embd), np.float32), True)], head)
            self.head.reset(0)
        from ..draft_length import Budget  # and the whole draft path once (its first pass in Python is slower)

        self.begin([0, 0, 0], 0, HiddenRows(0, np.zeros((2, self.n_embd), np.float32)))
        self.propose([DraftRequest(0, [0, 0, 0], Budget(2))])
        self.end(0, complete=False)

    # -- lifecycle ------------------------------------------------------------------------------

    def begin(self, prompt_ids: Sequence[int], seq: int = 0, hidden: HiddenRows | None = None) -> None:
        """The prompt is in the target but for its last token; ``hidden`` has the target's rows of what it computed
        for this prompt (from the position where a reused prefix ended). The head catches up on the prompt now
        (prompt processing, like the prefill)."""
        prompt = [int(t) for t in prompt_ids]
        start = hidden.start if hidden is not None else max(0, len(prompt) - 1)
        st = self._reuse(seq, prompt, start)
        if hidden is not None and len(hidden):
            st.put(hidden)
        end = len(prompt) - 1
        if self.head.shared:  # the assistant reads the target's KV: no pairs of its own to catch up
            st.n_kv = end
        elif end > st.n_kv:
            self.head.catch_up([MtpRow(seq, st.n_kv, prompt[st.n_kv:end], st.before(st.n_kv, end, self.n_embd))])
            st.n_kv = end
        st.tokens = prompt

    def _reuse(self, seq: int, prompt: list[int], start: int) -> _Seq:
        """The sequence's state for a prompt whose first ``start`` positions the target kept from before: this slot's
        own MTP cache and rows where they hold that prefix, else another slot's (copied: the cache is unified),
        else the head starts at ``start`` with no rows before it (drafts are then weaker until it has seen more)."""
        found = self._holder(seq, prompt, start, lambda o: o.n_h) if start > 0 else None
        if found is not None:
            src, other = found
            keep = min(other.n_kv, start)  # pairs past it are caught up from the rows (``begin``)
            fresh = _Seq(tokens=prompt[:start], n_kv=keep)
            fresh.put(HiddenRows(0, other.h[:start].copy()))
            return self._take_over(seq, src, keep, fresh)
        self.head.reset(seq)
        fresh = self._seqs[seq] = _Seq(n_kv=start, n_h=0)
        return fresh

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0, hidden: HiddenRows | None = None) -> None:
        st = self._seqs.get(seq)
        if st is None:
            return
        self._clean(seq, st)
        if hidden is not None and len(hidden):
            st.put(hidden)
        st.tokens.extend(int(t) for t in new_ids)
        if self.head.shared:
            st.n_kv = min(len(st.tokens) - 1, st.n_h + 1)
        # otherwise the pairs of plain steps wait for the next draft (``_behind``)

    # -- the host prompt cache -----------------------------------------------------------------------

    def save_prefix(self, seq: int, tokens: Sequence[int]) -> tuple[_Saved, int] | None:
        """What the head holds for ``tokens`` (the slot's cached prefix): its cache and the target's rows it
        read, so that a restore of the target's KV brings them back (without, the head would start at the
        restored prefix's end and attend to nothing before it). None where it holds something else."""
        st = self._seqs.get(seq)
        n = len(tokens)
        if st is None or st.h is None or st.n_h < n or st.tokens[:n] != list(tokens) or st.window:
            return None  # (a window holds too little of the prefix to be worth keeping)
        self._clean(seq, st)
        saved = _Saved(list(tokens), st.h[:n].copy(), min(st.n_kv, n), self.head.save_seq(seq))
        return saved, saved.h.nbytes + len(saved.kv)

    def restore_prefix(self, seq: int, saved: "_Saved") -> None:
        """The head's state for a prefix the engine restored into ``seq`` (``save_prefix``); ``begin`` keeps it."""
        if not self.head.load_seq(seq, saved.kv):
            self._seqs.pop(seq, None)
            return
        st = _Seq(tokens=list(saved.tokens), n_kv=saved.n_kv)
        st.put(HiddenRows(0, saved.h))
        self.head.truncate(seq, saved.n_kv)
        self._seqs[seq] = st

    # -- drafting ---------------------------------------------------------------------------------

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        t0 = time.perf_counter()
        live = [r for r in requests if r.budget.max_tokens > 0]
        drafts = {r.seq: DraftChain() for r in live}
        if live:
            (self._draft_chained if self.head.chained else self._draft_shared if self.head.shared
             else self._draft_single)(live, drafts, t0)
        return [Draft.empty(self.name) if r.seq not in drafts else drafts[r.seq].draft(self.name) for r in requests]

    def _draft_single(self, live: list[DraftRequest], drafts: dict[int, DraftChain], t0: float) -> None:
        """One head: the catch-up pairs and the first draft row in one call, then the head on its own rows."""
        rows = []
        for r in live:
            st = self._seqs.setdefault(r.seq, _Seq())
            self._clean(r.seq, st)
            n = len(r.context)
            self._behind(r, st)
            start = min(st.n_kv, n - 1)
            if start < st.n_kv:  # the context is shorter than the cache (a caller's own context): cut back
                self.head.truncate(r.seq, start)
            rows.append(MtpRow(r.seq, start, [int(t) for t in r.context[start:n]], st.before(start, n, self.n_embd), True))
            st.n_kv = n
        # Each drafted token goes next at its own position; its pair uses the head's row, not the target's (dirty).
        self._chain(live, rows, drafts, t0, lambda r, d: len(r.context) + len(d.tokens) - 1, True)

    def _draft_shared(self, live: list[DraftRequest], drafts: dict[int, DraftChain], t0: float) -> None:
        """The assistant (module docstring): one row per drafting generation a call, all at the position of the
        last committed token, which the target's KV does not hold yet (llama.cpp's ``pos0``): first that token
        with the target's row before it (``pending_h``), then each drafted token with the head's own row."""
        rows = []
        for r in live:
            st = self._seqs.setdefault(r.seq, _Seq())
            n = len(r.context)
            rows.append(MtpRow(r.seq, n - 1, [int(r.context[-1])], st.before(n - 1, n, self.n_embd), True))
        # Every row at ``pos0``; the target's KV is the cache, so nothing is left behind to cut (never dirty).
        self._chain(live, rows, drafts, t0, lambda r, d: len(r.context) - 1, False)

    def _chain(self, live: list[DraftRequest], rows: list[MtpRow], drafts: dict[int, DraftChain], t0: float,
               position: Callable[[DraftRequest, DraftChain], int], dirty: bool) -> None:
        """Run ``rows`` (one per drafting generation), take each generation's next token, and feed it back with
        the head's own row at ``position``, one call per draft position, until every draft has stopped."""
        while live:
            going, next_rows = [], []
            for r, out in zip(live, self.head.run(rows)):
                assert out is not None
                logits, h = out
                d = drafts[r.seq]
                if self._take(r, d, logits, t0):
                    going.append(r)
                    next_rows.append(MtpRow(r.seq, position(r, d), [d.tokens[-1]], h[None, :], True))
                    self._seqs[r.seq].dirty = dirty
            live, rows = going, next_rows

    def _behind(self, r: DraftRequest, st: _Seq) -> None:
        """Leave at most CATCH_UP pairs for the draft's first call: where more are missing, the cache starts afresh
        on the last CATCH_UP positions (``window``: nothing before them), as a probe's always did."""
        end = len(r.context) - 1 - CATCH_UP
        if end > st.n_kv:
            self.head.reset(r.seq)
            st.n_kv, st.window = end, True

    def _take(self, r: DraftRequest, d: DraftChain, logits: np.ndarray, t0: float) -> bool:
        """Pick the next token from ``logits`` and offer it to ``r``'s draft; whether to draft one more."""
        tok, conf, q = self._pick(logits, r.budget.keep_going is not None)
        return d.take(tok, conf, q, r.budget, self.config.p_min, self.name, t0)

    def _start(self, r: DraftRequest) -> tuple[int, list[int], np.ndarray]:
        """A chained draft's catch-up for ``r``: (first position, tokens, target rows) of the pairs from where the
        cache is correct through the last committed token (llama.cpp's ``id_last`` with ``pending_h``)."""
        st = self._seqs.setdefault(r.seq, _Seq())
        st.dirty = False  # every head's call removes the rows from ``start`` on first
        self._behind(r, st)
        n = len(r.context)
        start = min(st.n_kv, n - 1)
        st.n_kv = n
        return start, [int(t) for t in r.context[start:n]], st.before(start, n, self.n_embd)

    def _draft_chained(self, live: list[DraftRequest], drafts: dict[int, DraftChain], t0: float) -> None:
        """Chained heads (module docstring): one call per head, every generation in it. A drafting generation's
        rows are its catch-up pairs, then its drafted tokens with the rows of the heads that drafted them (head
        i's output row pairs with the token it drafted); one that stopped drafting still has its pairs caught up
        by the remaining heads (each head's KV must hold them)."""
        base = {r.seq: self._start(r) for r in live}
        rows_h: dict[int, list[np.ndarray]] = {r.seq: [] for r in live}
        going = {r.seq for r in live}
        for head in range(self.head.n_heads):
            rows = []
            for r in live:
                start, toks, h = base[r.seq]
                self.head.truncate(r.seq, start)
                d = drafts[r.seq]
                if r.seq in going:
                    rows.append(MtpRow(r.seq, start, toks + d.tokens, np.concatenate([h, *rows_h[r.seq]]), True))
                    self._seqs[r.seq].dirty = bool(d.tokens)
                else:
                    rows.append(MtpRow(r.seq, start, toks, h))
                    self._seqs[r.seq].dirty = False
            for r, out in zip(live, self.head.run(rows, head)):
                if out is None:
                    continue
                more = self._take(r, drafts[r.seq], out[0], t0)
                # the budget is clipped at the head count: position n_heads has no trained head to draft it
                if more and head + 1 < self.head.n_heads:
                    rows_h[r.seq].append(out[1][None, :])
                else:
                    going.discard(r.seq)




# The drafters that work on any target (no NextN layers, no second model): named when mtp cannot.
ALTERNATIVES = "prompt-lookup, suffix, rest (with --datastore) or draft-model (with -md DRAFT.gguf)"


def check_mtp_model(path, where: str = "--drafter mtp", assistant: Path | None = None,
                    alternatives: str = ALTERNATIVES) -> Path | None:
    """``check_mtp_meta`` on the GGUF at ``path``, its metadata read here (milliseconds, before any load)."""
    from ..modelfile.meta import read_gguf

    return check_mtp_meta(read_gguf(path, tensors=False), getattr(path, "name", str(path)), where, assistant,
                          alternatives)


def check_mtp_meta(meta: "GGUFInfo", name: str, where: str = "--drafter mtp", assistant: Path | None = None,
                   alternatives: str = ALTERNATIVES) -> Path | None:
    """Refuse, from a model's GGUF metadata (``meta``, read once by the caller: ``check_mtp_model``, or the loaded
    target's own), a model whose NextN layers this llama.cpp cannot draft from: one line naming the model
    (``name``) and ``alternatives``, the drafters that can work where it is asked (a server has no datastore and
    no second -md). Return the assistant GGUF to draft with (``assistant``, for a target whose head ships apart:
    gemma4), else None (the target's own NextN layers; an ``assistant`` given for such a target is not this
    drafter's: None)."""
    wanted = meta.mtp_assistant_arch
    if wanted is not None:
        return _check_assistant(name, meta.architecture, wanted, assistant, where, alternatives)
    if meta.nextn_layers == 0:
        raise UnsupportedModelError(f"{where}: {name} ({meta.architecture}) has no multi-token-prediction (NextN) "
                                    f"layers to draft from; use {alternatives}")
    mode = meta.mtp_mode
    if mode is None:
        raise UnsupportedModelError(f"{where}: {name} declares {meta.nextn_layers} NextN layer(s), but this llama.cpp "
                                    f"has no MTP graph for its architecture {meta.architecture!r}; use {alternatives}")
    if mode == "assistant":
        raise UnsupportedModelError(f"{where}: {name} ({meta.architecture}) is an MTP assistant, not a model to "
                                    "generate with: give its target with -m and this file with -md")
    if mode not in ("single head", "chained heads"):
        raise UnsupportedModelError(f"{where}: {name} ({meta.architecture}) drafts with {mode}, which specstack's MTP "
                                    f"drafter does not run yet; use {alternatives}")
    return None


def _check_assistant(name: str, arch: str, wanted: str, assistant: Path | None, where: str,
                     alternatives: str) -> Path:
    """The ``-md`` file of a target whose MTP head ships apart (gemma4): given, and of the head's architecture."""
    from ..modelfile.meta import read_gguf

    if assistant is None:
        raise UnsupportedModelError(f"{where}: {name} ({arch}) drafts with a separate MTP assistant model: give it "
                                    f"with -md ASSISTANT.gguf (a {wanted} GGUF), or use {alternatives}")
    got = read_gguf(assistant, tensors=False).architecture
    if got != wanted:
        raise UnsupportedModelError(f"{where}: -md {Path(assistant).name} is {got!r}, not the {wanted} assistant "
                                    f"that {name} ({arch}) drafts with")
    return Path(assistant)


_noted: set[str] = set()


def note_mtp(meta: "GGUFInfo", command: str = "specstack") -> None:
    """On stderr, once per model and process: the model (``meta``, its GGUF metadata, read once by the caller)
    ships NextN layers this llama.cpp drafts from, and ``--drafter mtp`` was not chosen."""
    key = str(meta.path)
    if key in _noted:
        return
    _noted.add(key)
    if meta.mtp_mode in ("single head", "chained heads"):
        print(f"specstack {command}: note: {Path(meta.path).name} has {meta.nextn_layers} multi-token-prediction "
              "(NextN) layer(s); --drafter mtp drafts from them (or cascade:suffix,mtp)", file=sys.stderr, flush=True)


def _check_target(meta: "GGUFInfo", asked: Asked) -> Path | None:
    """``Needs.check``: NextN layers this llama.cpp drafts from (``check_mtp_meta``), or gemma4's assistant given as
    ``draft_model`` (-md); returns the assistant."""
    return check_mtp_meta(meta, Path(meta.path).name, asked.where, asked.options.get("draft_model"),
                          asked.alternatives or ALTERNATIVES)


def _offered(meta: "GGUFInfo") -> bool:
    """``Needs.offered``: the model ships one NextN head this llama.cpp drafts from."""
    return meta.mtp_mode == "single head"


# llama.cpp drafts from the target's own NextN layers too: --spec-type draft-mtp
@register(NAME, needs=Needs(head=True, check=_check_target, offered=_offered),
          llama=LlamaCpp(spec_types=("draft-mtp",), peers=("llama-draft-mtp",)))
def _build(ctx: BuildContext) -> Drafter:
    config = config_from_options(MtpConfig, ctx.options)
    assistant = None
    if isinstance(ctx.target, MtpTarget):  # the metadata it was loaded from: not read again
        assistant = check_mtp_meta(ctx.target.meta, ctx.target.path.name, assistant=config.draft_model)
    elif ctx.target.path is not None:
        assistant = check_mtp_model(ctx.target.path, assistant=config.draft_model)
    config = replace(config, draft_model=assistant)  # -md read by draft-model in a cascade is not the head's
    if not isinstance(ctx.target, MtpTarget):
        raise UnsupportedModelError("--drafter mtp drafts from a loaded target's NextN head (not a replay)")
    return MtpDrafter(ctx.target, ctx.temperature, config)
