"""EAGLE-3: drafts from a trained EAGLE-3 head GGUF beside the target, as llama.cpp's ``--spec-type draft-eagle3``.

The head (``-md HEAD.gguf``, ``general.architecture`` eagle3) reads the inputs of three target layers per token
(``HiddenStates.want_hidden(layers)``: ``[L_a | L_b | L_c]``); its encoder turns each such feature row f_P into a
row g_P, and its one decoder layer runs pairs on its own KV cache (``llama.heads.Eagle3Context``). It is MTP
shifted by one position: MTP's pair at p is ``(x_p, h_{p-1})``, EAGLE-3's at P is ``(x_{P+1}, g_P)`` (llama.cpp's
convention, ``common_speculative_impl_draft_eagle3``), and its output at P predicts x_{P+2}. A chained step feeds the
drafted token with the head's own pre-norm row at the next position.

The head conditions on the target: it declares ``needs_hidden``, and the engine hands it the target's feature rows
of every token the target kept (rows of rejected drafts never arrive, so, unlike llama.cpp's driver, no pair of a
rejected row is ever computed). For a context x_0..x_{n-1} whose last token the target has not computed yet, the
pairs at positions 0..n-2 are all known; the last one, ``(x_{n-1}, g_{n-2})``, is the draft's first row (llama.cpp's
deferred ``pending_g_last`` pair, rewritten by each draft). Rows are encoded lazily, for every drafting
generation in one encoder call, and their pairs caught up in the draft's first call, as the MTP drafter does
(after a long plain run, only the last ``CATCH_UP`` positions, in a cache started afresh).

Example: context ``[a, b, c]``, the target's rows f_a, f_b kept. A draft encodes g_a, g_b and runs
(b at 0, g_a), (c at 1, g_b) -> d0 and the head's row r0, then (d0 at 2, r0) -> d1. The target accepts d0 and emits t:
the engine hands f_c, f_d0. The next draft drops the chained row at 2, encodes g_c, g_d0 and runs (d0 at 2, g_c),
(t at 3, g_d0) -> the next draft, in one call.

Why ``-md`` names the head (and not an option of its own): it is the flag llama.cpp's own ``--spec-type
draft-eagle3`` reads the head from (``-md HEAD.gguf``), and the MTP drafter reads gemma4's assistant from it the same
way, so a command line moves between specstack and llama.cpp unchanged. The head is checked against the target's
metadata before anything loads (``Needs.check``: ``modelfile.compat.head_problems``), one line per mismatch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import UnsupportedModelError
from ..llama.mtp import MtpRow
from ..llama.target import LayerInputsTarget
from ..types import Draft, HiddenRows
from .base import (Asked, BuildContext, DraftChain, Drafter, DraftRequest, LlamaCpp, ModelDraftConfig, Needs,
                   config_from_options, register)
from .mtp import CATCH_UP, HeadSlots

if TYPE_CHECKING:
    from ..modelfile.meta import GGUFInfo

NAME = "eagle3"

# Feature rows kept unencoded per sequence (between PENDING_MAX and twice it, ``_Seq.trim``): after a plain run the
# draft reads only the last CATCH_UP positions (``_behind``), so older rows would never be encoded; a long plain run
# must not pile them up.
PENDING_MAX = 4 * CATCH_UP


@dataclass(frozen=True)
class Eagle3Config(ModelDraftConfig):
    """``draft_model`` (-md): the EAGLE-3 head GGUF (required); sampling as ``ModelDraftConfig``."""

    draft_model: Path | None = None


@dataclass
class _Seq:
    """What the head's cache and the row store hold for one sequence (slot); kept after ``end`` for prefix reuse."""

    tokens: list[int] = field(default_factory=list)  # the context: prompt, then committed tokens
    g: np.ndarray | None = None  # encoded rows by position (zeros where none was computed)
    n_g: int = 0  # g is settled for positions [0, n_g)
    pending: list[np.ndarray] = field(default_factory=list)  # feature rows of positions [n_g, n_rows), not encoded
    n_kv: int = 0  # the head's cache holds correct pairs for positions [0, n_kv) (or [start, n_kv) in a window)
    dirty: bool = False  # chained draft rows sit at positions >= n_kv
    window: bool = False  # the cache was started afresh at n_kv after a plain run: nothing before it

    @property
    def n_rows(self) -> int:
        """The position after the last feature row known (encoded or pending)."""
        return self.n_g + sum(len(b) for b in self.pending)

    def put(self, rows: HiddenRows) -> None:
        """Take the target's feature rows ``rows``; rows known past their start belonged to tokens that were cut, and
        so do the pairs from there on."""
        start, width = rows.start, rows.rows.shape[1]
        if start < self.n_rows:
            self.n_kv = min(self.n_kv, start)
            if start < self.n_g:
                self.n_g, self.pending = start, []
            else:
                self.pending = [np.concatenate(self.pending)[: start - self.n_g]] if self.pending else []
        elif start > self.n_rows:  # positions the engine handed nothing for: zeros, as the MTP drafter's
            self.pending.append(np.zeros((start - self.n_rows, width), np.float32))
        self.pending.append(rows.rows)

    def trim(self) -> None:
        """Forget unencoded rows too far behind to be read again (``PENDING_MAX``; their g is zeros): after a plain
        step, never at ``begin``, whose prompt rows are all encoded and caught up at once."""
        excess = self.n_rows - self.n_g - PENDING_MAX
        if excess > PENDING_MAX:  # at most every PENDING_MAX plain steps: one copy of the rows kept, not one a step
            if self.g is not None:
                self.g[self.n_g : self.n_g + excess] = 0.0
            kept = np.concatenate(self.pending)[excess:]
            self.n_g, self.pending = self.n_g + excess, [kept]

    def features(self, lo: int) -> tuple[int, np.ndarray | None]:
        """(first position, feature rows) still to encode from position ``lo`` on; those before ``lo`` are dropped
        (their pairs are in the cache, or never will be: a window starts after them)."""
        if not self.pending:
            return self.n_g, None
        rows = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        skip = max(0, lo - self.n_g)
        return self.n_g + skip, (rows[skip:] if skip < len(rows) else None)

    def store(self, start: int, g: np.ndarray | None, n_embd: int) -> None:
        """The encoded rows ``g`` from position ``start``; every pending row is settled (encoded or skipped)."""
        end = self.n_rows
        if self.g is None or self.g.shape[0] < end:
            grown = np.zeros((max(end, 2 * (0 if self.g is None else self.g.shape[0]), 64), n_embd), np.float32)
            if self.g is not None:  # rows past its end are zeros (``trim`` may settle positions it never held)
                kept = min(self.n_g, self.g.shape[0])
                grown[:kept] = self.g[:kept]
            self.g = grown
        self.g[self.n_g : end] = 0.0
        if g is not None:
            self.g[start : start + len(g)] = g
        self.n_g, self.pending = end, []

    def rows(self, start: int, end: int, n_embd: int) -> np.ndarray:
        """g rows for positions [start, end): zeros where none was computed."""
        out = np.zeros((end - start, n_embd), np.float32)
        hi = min(end, self.n_g, 0 if self.g is None else self.g.shape[0])
        if hi > start:
            out[: hi - start] = self.g[start:hi]
        return out


@dataclass(frozen=True)
class _Saved:
    """A sequence's head state for the host prompt cache (``Eagle3Drafter.save_prefix``)."""

    tokens: list[int]
    g: np.ndarray  # the encoded rows at positions [0, len(tokens))
    n_kv: int  # pairs the head's cache holds
    kv: bytes  # the head's cache (llama.cpp's per-sequence state)


class Eagle3Drafter(HeadSlots):
    """Drafts from an EAGLE-3 head (see the module docstring)."""

    name = NAME
    needs_hidden = True

    def __init__(self, target: LayerInputsTarget, temperature: float, config: Eagle3Config) -> None:
        assert config.draft_model is not None
        self.config = config
        self.head = target.open_eagle3(config.draft_model)
        target.want_hidden(self.head.target_layers)
        self.n_embd = self.head.n_embd
        self.n_vocab = target.n_vocab  # type: ignore[attr-defined]
        self.temperature = config.draft_temp if config.draft_temp is not None else temperature
        self._sampled = temperature > 0.0 and self.temperature > 0.0
        self._rng = np.random.default_rng(None if config.seed is None or config.seed < 0 else config.seed + 3)
        self._seqs: dict[int, _Seq] = {}
        self._warm_up()

    def _warm_up(self) -> None:
        """Throw-away calls, as for draft models: a context's first call of each graph allocates it, a spike the
        cost policy would otherwise charge to the first draft; then the whole draft path once."""
        from ..draft_length import Budget

        self.head.encode(np.zeros((2, self.head.n_embd_enc), np.float32))
        for n in (2, 1):
            self.head.run([MtpRow(0, 0, [0] * n, np.zeros((n, self.n_embd), np.float32), output=True)])
            self.head.reset(0)
        self.begin([0, 0, 0], 0, HiddenRows(0, np.zeros((2, self.head.n_embd_enc), np.float32)))
        self.propose([DraftRequest(0, [0, 0, 0], Budget(2))])
        self.end(0, complete=False)

    # -- lifecycle ------------------------------------------------------------------------------

    def begin(self, prompt_ids: Sequence[int], seq: int = 0, hidden: HiddenRows | None = None) -> None:
        """The prompt is in the target but for its last token; ``hidden`` has the target's feature rows of what it
        computed (from where a reused prefix ended). The head catches up on the prompt's pairs now (prompt
        processing, as llama.cpp's driver and the MTP drafter do), all but the last, which the first draft runs.
        Deferring it to the first draft was tried: a cost-policy probe then pays the whole prompt's pass in the
        decode (16 ms against a 0.5 ms step on pycoder-6m), and cutting it to the last 8 or 32 positions
        loses acceptance (458/555 against 468/545 accepted at k 1, 670/1029 against 690/967 at k 3, 8 held-out
        prompts of ~340 tokens, 128 tokens each)."""
        prompt = [int(t) for t in prompt_ids]
        start = hidden.start if hidden is not None else max(0, len(prompt) - 1)
        st = self._reuse(seq, prompt, start)
        if hidden is not None and len(hidden):
            st.put(hidden)
        st.tokens = prompt
        end = len(prompt) - 2
        if end > st.n_kv:
            self._encode([st], [st.n_kv])
            self.head.run([MtpRow(seq, st.n_kv, prompt[st.n_kv + 1 : end + 1], st.rows(st.n_kv, end, self.n_embd))])
            st.n_kv = end

    def _reuse(self, seq: int, prompt: list[int], start: int) -> _Seq:
        """The sequence's state for a prompt whose first ``start`` positions the target kept from before: this slot's
        own cache and rows where they hold that prefix, else another slot's (copied: the cache is unified), else the
        head starts at ``start`` with nothing before it (drafts are weaker until it has seen more)."""
        found = self._holder(seq, prompt, start, lambda o: o.n_rows) if start > 0 else None
        if found is not None:
            src, other = found
            self._encode([other], [0])  # its rows of the prefix, all as g
            assert other.g is not None
            keep = min(other.n_kv, start)  # pairs past it are caught up from the rows
            fresh = _Seq(tokens=prompt[:start], g=other.g[:start].copy(), n_g=start, n_kv=keep, window=other.window)
            return self._take_over(seq, src, keep, fresh)
        self.head.reset(seq)
        fresh = self._seqs[seq] = _Seq(n_g=start, n_kv=start)
        return fresh

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0, hidden: HiddenRows | None = None) -> None:
        st = self._seqs.get(seq)
        if st is None:
            return
        self._clean(seq, st)
        if hidden is not None and len(hidden):
            st.put(hidden)
        st.trim()
        st.tokens.extend(int(t) for t in new_ids)
        # the pairs wait for the next draft (``_behind``)

    # -- the host prompt cache -----------------------------------------------------------------------

    def save_prefix(self, seq: int, tokens: Sequence[int]) -> tuple[_Saved, int] | None:
        """What the head holds for ``tokens`` (the slot's cached prefix): its cache and the encoded rows of the
        prefix (rows still pending are encoded now, one encoder call), so that a restore of the target's KV brings
        them back; without, the head would start at the restored prefix's end and attend to nothing before it.
        None where it holds something else, or a window after a plain run (too little of the prefix to keep)."""
        st = self._seqs.get(seq)
        n = len(tokens)
        if st is None or st.window or st.n_rows < n or st.tokens[:n] != list(tokens):
            return None
        self._clean(seq, st)
        self._encode([st], [0])
        if st.g is None or st.n_g < n:
            return None
        saved = _Saved(list(tokens), st.g[:n].copy(), min(st.n_kv, n - 1), self.head.save_seq(seq))
        return saved, saved.g.nbytes + len(saved.kv)

    def restore_prefix(self, seq: int, saved: _Saved) -> None:
        """The head's state for a prefix the engine restored into ``seq`` (``save_prefix``); ``begin`` keeps it."""
        if not self.head.load_seq(seq, saved.kv):
            self._seqs.pop(seq, None)
            return
        n = len(saved.tokens)
        self.head.truncate(seq, saved.n_kv)
        self._seqs[seq] = _Seq(tokens=list(saved.tokens), g=saved.g.copy(), n_g=n, n_kv=saved.n_kv)

    # -- drafting ---------------------------------------------------------------------------------

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        t0 = time.perf_counter()
        live = [r for r in requests if r.budget.max_tokens > 0 and len(r.context) >= 2]
        drafts = {r.seq: DraftChain() for r in live}
        if live:
            self._draft(live, drafts, t0)
        return [drafts[r.seq].draft(self.name) if r.seq in drafts else Draft.empty(self.name) for r in requests]

    def _draft(self, live: list[DraftRequest], drafts: dict[int, DraftChain], t0: float) -> None:
        """One encoder call for every drafting generation's new rows, one call of their catch-up pairs and first
        draft rows, then the head on its own rows, one call per draft position."""
        starts = []
        for r in live:
            st = self._seqs.setdefault(r.seq, _Seq())
            self._clean(r.seq, st)
            self._behind(r, st)
            start = min(st.n_kv, len(r.context) - 2)
            if start < st.n_kv:  # the context is shorter than the cache (a caller's own context): cut back
                self.head.truncate(r.seq, start)
            starts.append(start)
        self._encode([self._seqs[r.seq] for r in live], starts)
        rows = []
        for r, start in zip(live, starts):
            st, n = self._seqs[r.seq], len(r.context)
            rows.append(MtpRow(r.seq, start, [int(t) for t in r.context[start + 1 : n]],
                               st.rows(start, n - 1, self.n_embd), True))
            st.n_kv = n - 1
        while live:  # each drafted token goes next at its own position, with the head's row (dirty)
            going, next_rows = [], []
            for r, out in zip(live, self.head.run(rows)):
                assert out is not None
                logits, h = out
                d = drafts[r.seq]
                if self._take(r, d, logits, t0):
                    going.append(r)
                    next_rows.append(MtpRow(r.seq, len(r.context) - 2 + len(d.tokens), [d.tokens[-1]], h[None, :], True))
                    self._seqs[r.seq].dirty = True
            live, rows = going, next_rows

    def _encode(self, seqs: list[_Seq], starts: list[int]) -> None:
        """Encode the pending feature rows of ``seqs`` from their ``starts`` on, all in one encoder call (split only by
        the batch size)."""
        parts = [st.features(lo) for st, lo in zip(seqs, starts)]
        blocks = [f for _, f in parts if f is not None and len(f)]
        g = self.head.encode(np.concatenate(blocks)) if blocks else None
        at = 0
        for st, (first, f) in zip(seqs, parts):
            n = 0 if f is None else len(f)
            st.store(first, None if g is None or n == 0 else g[at : at + n], self.n_embd)
            at += n

    def _behind(self, r: DraftRequest, st: _Seq) -> None:
        """Leave at most CATCH_UP pairs for the draft's first call: where more are missing, the cache starts afresh
        on the last CATCH_UP positions (``window``: nothing before them), as the MTP drafter's."""
        end = len(r.context) - 2 - CATCH_UP
        if end > st.n_kv:
            self.head.reset(r.seq)
            st.n_kv, st.window = end, True

    def _take(self, r: DraftRequest, d: DraftChain, logits: np.ndarray, t0: float) -> bool:
        """Pick the next token from ``logits`` and offer it to ``r``'s draft; whether to draft one more."""
        tok, conf, q = self._pick(logits, r.budget.keep_going is not None)
        return d.take(tok, conf, q, r.budget, self.config.p_min, self.name, t0)



def check_head(meta: "GGUFInfo", head: Path | None, where: str = "--drafter eagle3") -> Path:
    """Refuse, from GGUF metadata alone (milliseconds, before any load), an EAGLE-3 head that cannot draft for the
    target of ``meta``: none given, not an eagle3 GGUF, or a mismatch ``modelfile.compat.head_problems`` names (a
    layer past the target's, another hidden size or tokenizer, a target graph without layer inputs: llama.cpp would
    refuse it at load or abort the process at the first call). One line, every mismatch in it; returns ``head``."""
    from ..modelfile.compat import HeadTarget, compare, head_problems
    from ..modelfile.meta import read_gguf

    if head is None:
        raise UnsupportedModelError(f"{where} drafts from a trained EAGLE-3 head: give it with -md HEAD.gguf (the "
                                    "head converted for this target, as llama.cpp's --spec-type draft-eagle3 reads it)")
    info = read_gguf(head, role="EAGLE-3 head")
    name = Path(head).name
    if info.head is None or info.head.kind != "eagle3":
        raise UnsupportedModelError(f"{where}: -md {name} is {info.architecture!r}, not an EAGLE-3 head "
                                    "(general.architecture eagle3); a draft model drafts with --drafter draft-model")
    problems = head_problems(HeadTarget.of(meta), info.head, name, compare(meta, info).verdict)
    if problems:
        raise UnsupportedModelError(f"{where}: -md {name} cannot draft for {Path(meta.path).name}: "
                                    + "; ".join(problems))
    return Path(head)


def _check_target(meta: "GGUFInfo", asked: Asked) -> Path:
    """``Needs.check``: the head given as ``draft_model`` (-md) fits the target (``check_head``); returns it."""
    return check_head(meta, asked.options.get("draft_model"), asked.where)


# llama.cpp's job of the same name: llama-server's --spec-type draft-eagle3 -md HEAD, and its
# llama-speculative-simple beside this drafter in the bench (the head is the bench's -md)
@register(NAME, needs=Needs(head=True, check=_check_target),
          llama=LlamaCpp(spec_types=("draft-eagle3",), peers=("llama-draft-eagle3",)))
def _build(ctx: BuildContext) -> Drafter:
    config = config_from_options(Eagle3Config, ctx.options)
    if not isinstance(ctx.target, LayerInputsTarget):
        raise UnsupportedModelError("--drafter eagle3 drafts from a loaded target's layer inputs (not a replay)")
    head = check_head(ctx.target.meta, config.draft_model)  # the metadata it was loaded from: not read again
    return Eagle3Drafter(ctx.target, ctx.temperature, replace(config, draft_model=head))
