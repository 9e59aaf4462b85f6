"""DFlash: drafts a block at once from a trained DFlash head GGUF beside the target, as llama.cpp's ``--spec-type
draft-dflash``.

The head (``-md HEAD.gguf``, ``general.architecture`` dflash, no DSpark Markov tensors) reads the inputs of the target
layers it names per token (``HiddenStates.want_hidden(layers)``: ``[L_a | L_b | ...]``). Its cache holds those feature
rows, projected into each layer's K/V at the target's positions (``llama.heads.DFlashContext.inject``); a draft is one
call of the block ``[x_{n-1}, MASK x (L-1)]`` at positions n-1.. with non-causal attention, where slot i >= 1 predicts
x_{n-1+i} (in-place denoising: llama.cpp's ``common_speculative_impl_draft_dflash``). So a draft of any length costs
one head call for every drafting generation together, and k is at most ``block_size - 1``.

Block length: always the head's ``block_size`` (L), whatever the step's budget. Attention inside the block is
non-causal, so a shorter block changes what the earlier slots predict: with a budget-sized block the draft at one
context would differ from step to step as the cost policy moves k, and so would the acceptance it learns per draft
length. The full block is what llama.cpp's driver runs at its defaults (``--spec-draft-n-max`` 16, clamped to
``block_size - 1``: a block of ``block_size`` rows) and what a DFlash head is trained on; its extra rows cost one
head call's width, not another call. (llama.cpp run with a smaller ``--spec-draft-n-max k`` runs k+1 rows instead:
its drafts then differ from these, though both are verified exactly.)

The head conditions on the target: it declares ``needs_hidden``, and the engine hands it the target's feature rows
of every token the target kept (rows of rejected drafts never arrive, so, unlike llama.cpp's driver, no rejected row
is ever injected and none needs cutting). For a context x_0..x_{n-1} the rows of positions 0..n-2 are known, and a
draft injects those not yet in the cache, for every drafting generation in one call, then runs the blocks in one
call; the block rows are cut right after it. After a plain step the rows wait, at most ``PENDING_MAX`` per sequence:
then they are injected at once, since the injected rows are the head's whole view of the context (a window, as the
EAGLE-3 drafter's, would forget the prompt) and injecting costs a projection per row, no attention. The host prompt
cache keeps a prefix's head cache beside the target's KV (``save_prefix``/``restore_prefix``), for the same reason.

Example: context ``[a, b, c]``, the target's rows f_a, f_b kept. A draft injects f_a at 0, f_b at 1 and runs the block
``[c, M, M, ...]`` at 2..: slots 1, 2, ... give d0, d1, ... The target accepts d0 and emits t: the engine hands f_c,
f_d0. The next draft injects f_c at 2, f_d0 at 3 and runs ``[t, M, ...]`` at 4.. .

As for EAGLE-3, ``-md`` names the head: the flag llama.cpp's ``--spec-type draft-dflash`` reads it from, so a command
line moves between specstack and llama.cpp unchanged; it is checked against the target's metadata before anything
loads (``Needs.check``: ``modelfile.compat.head_problems``), one line for every mismatch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import UnsupportedModelError
from ..llama.target import LayerInputsTarget
from ..types import Draft, HiddenRows
from .base import (Asked, BuildContext, DraftChain, Drafter, DraftRequest, LlamaCpp, ModelDraftConfig, Needs,
                   config_from_options, register)
from .mtp import CATCH_UP, HeadSlots

if TYPE_CHECKING:
    from ..modelfile.meta import GGUFInfo

NAME = "dflash"

# Feature rows kept uninjected per sequence at most: after this many plain steps they go into the head's cache in one
# call of their own (``DFlashDrafter.advance``), so a long plain run neither piles rows up nor leaves one large call
# for the next draft to pay.
PENDING_MAX = 4 * CATCH_UP


@dataclass(frozen=True)
class DFlashConfig(ModelDraftConfig):
    """``draft_model`` (-md): the DFlash head GGUF (required); sampling as ``ModelDraftConfig``."""

    draft_model: Path | None = None


@dataclass
class _Seq:
    """What the head's cache and the row store hold for one sequence (slot); kept after ``end`` for prefix reuse."""

    tokens: list[int] = field(default_factory=list)  # the context: prompt, then committed tokens
    n_kv: int = 0  # the head's cache holds the rows of positions [start, n_kv), start 0 or where the head began
    pending: list[np.ndarray] = field(default_factory=list)  # rows of positions [n_kv, n_rows), not injected yet
    stale: bool = False  # the cache holds rows past n_kv that were cut (``put``): cut them from the cache too
    dirty: bool = False  # (``HeadSlots``) never set: a block's rows leave the cache with the call

    @property
    def n_rows(self) -> int:
        """The position after the last feature row known (injected or pending)."""
        return self.n_kv + sum(len(b) for b in self.pending)

    def put(self, rows: HiddenRows) -> None:
        """Take the target's feature rows ``rows``; rows known past their start belonged to tokens that were cut."""
        start, width = rows.start, rows.rows.shape[1]
        if start < self.n_rows:
            if start < self.n_kv:
                self.n_kv, self.pending, self.stale = start, [], True
            else:
                self.pending = [np.concatenate(self.pending)[: start - self.n_kv]] if self.pending else []
        elif start > self.n_rows:  # positions the engine handed nothing for: zeros (llama.cpp wants no gap)
            self.pending.append(np.zeros((start - self.n_rows, width), np.float32))
        self.pending.append(rows.rows)

    def take(self, end: int, width: int) -> tuple[int, np.ndarray | None]:
        """(first position, rows) to inject for positions [n_kv, end): zeros where none is known; rows past ``end``
        stay pending. The cache then holds [.., end)."""
        if end <= self.n_kv:
            return self.n_kv, None
        rows = np.concatenate(self.pending) if len(self.pending) > 1 else \
            self.pending[0] if self.pending else np.zeros((0, width), np.float32)
        need = end - self.n_kv
        if len(rows) < need:
            rows = np.concatenate([rows, np.zeros((need - len(rows), width), np.float32)])
        first = self.n_kv
        self.pending = [rows[need:]] if len(rows) > need else []
        self.n_kv = end
        return first, rows[:need]


@dataclass(frozen=True)
class _Saved:
    """A sequence's head state for the host prompt cache (``DFlashDrafter.save_prefix``)."""

    tokens: list[int]
    kv: bytes  # the head's cache of the prefix's rows (llama.cpp's per-sequence state)


class DFlashDrafter(HeadSlots):
    """Drafts from a DFlash head (see the module docstring)."""

    name = NAME
    needs_hidden = True

    def __init__(self, target: LayerInputsTarget, temperature: float, config: DFlashConfig) -> None:
        assert config.draft_model is not None
        self.config = config
        self.head = target.open_dflash(config.draft_model)
        target.want_hidden(self.head.target_layers)
        self.width = self.head.n_embd_enc
        self.n_vocab = target.n_vocab  # type: ignore[attr-defined]
        self.temperature = config.draft_temp if config.draft_temp is not None else temperature
        self._sampled = temperature > 0.0 and self.temperature > 0.0
        self._rng = np.random.default_rng(None if config.seed is None or config.seed < 0 else config.seed + 4)
        self._seqs: dict[int, _Seq] = {}
        self._warm_up()

    @property
    def k_max(self) -> int:
        """The longest draft: every block slot after the first."""
        return self.head.block_size - 1

    def _warm_up(self) -> None:
        """Throw-away calls, as for draft models: a context's first call of each graph allocates it, a spike the
        cost policy would otherwise charge to the first draft; then the whole draft path once."""
        from ..draft_length import Budget

        self.head.inject([(0, 0, np.zeros((2, self.width), np.float32))])
        self.head.block([(0, 2, 0)])
        self.head.reset(0)
        self.begin([0, 0, 0], 0, HiddenRows(0, np.zeros((2, self.width), np.float32)))
        self.propose([DraftRequest(0, [0, 0, 0], Budget(2))])
        self.end(0, complete=False)

    # -- lifecycle ------------------------------------------------------------------------------

    def begin(self, prompt_ids: Sequence[int], seq: int = 0, hidden: HiddenRows | None = None) -> None:
        """The prompt is in the target but for its last token; ``hidden`` has the target's feature rows of what it
        computed (from where a reused prefix ended). They go into the head's cache now (prompt processing, like the
        prefill)."""
        prompt = [int(t) for t in prompt_ids]
        start = hidden.start if hidden is not None else max(0, len(prompt) - 1)
        st = self._reuse(seq, prompt, start)
        if hidden is not None and len(hidden):
            st.put(hidden)
        st.tokens = prompt
        self._inject([(seq, st, len(prompt) - 1)])

    def _reuse(self, seq: int, prompt: list[int], start: int) -> _Seq:
        """The sequence's state for a prompt whose first ``start`` positions the target kept from before: this slot's
        own cache where it holds that prefix, else another slot's (copied: the cache is unified), else the head
        starts at ``start`` with nothing before it (drafts are weaker until it has seen more)."""
        found = self._holder(seq, prompt, start, lambda o: o.n_rows) if start > 0 else None
        if found is not None:
            src, other = found
            self._inject([(src, other, start)])  # its rows of the prefix, all in its cache
            keep = min(other.n_kv, start)
            return self._take_over(seq, src, keep, _Seq(tokens=prompt[:start], n_kv=keep))
        self.head.reset(seq)
        fresh = self._seqs[seq] = _Seq(n_kv=start)
        return fresh

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0, hidden: HiddenRows | None = None) -> None:
        st = self._seqs.get(seq)
        if st is None:
            return
        if hidden is not None and len(hidden):
            st.put(hidden)
        st.tokens.extend(int(t) for t in new_ids)
        if st.n_rows - st.n_kv >= PENDING_MAX:  # a plain run: its rows go in now (module docstring)
            self._inject([(seq, st, st.n_rows)])
        # otherwise they wait for the next draft

    # -- the host prompt cache -----------------------------------------------------------------------

    def save_prefix(self, seq: int, tokens: Sequence[int]) -> tuple[_Saved, int] | None:
        """What the head holds for ``tokens`` (the slot's cached prefix): its cache with the rows of every position of
        the prefix, so that a restore of the target's KV brings them back (without, the head would start at the
        restored prefix's end and see nothing before it). None where it holds something else, or less than the
        whole prefix."""
        st = self._seqs.get(seq)
        n = len(tokens)
        if st is None or st.n_rows < n or st.tokens[:n] != list(tokens):
            return None
        self._inject([(seq, st, n)])  # the prefix's pending rows, so the cache holds all of it
        if self.head.pos_min(seq) != 0:  # the head began past a prefix it never saw: too little to keep
            return None
        saved = _Saved(list(tokens), self.head.save_seq(seq))
        return saved, len(saved.kv)

    def restore_prefix(self, seq: int, saved: _Saved) -> None:
        """The head's state for a prefix the engine restored into ``seq`` (``save_prefix``); ``begin`` keeps it."""
        if not self.head.load_seq(seq, saved.kv):
            self._seqs.pop(seq, None)
            return
        n = len(saved.tokens)
        self.head.truncate(seq, n)
        self._seqs[seq] = _Seq(tokens=list(saved.tokens), n_kv=n)

    # -- drafting ---------------------------------------------------------------------------------

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        t0 = time.perf_counter()
        live = [r for r in requests if r.budget.max_tokens > 0 and len(r.context) >= 1]
        drafts = {r.seq: DraftChain() for r in live}
        if live:
            self._draft(live, drafts, t0)
        return [drafts[r.seq].draft(self.name) if r.seq in drafts else Draft.empty(self.name) for r in requests]

    def _draft(self, live: list[DraftRequest], drafts: dict[int, DraftChain], t0: float) -> None:
        """One injection call for every drafting generation's new rows, one call of all their blocks, then each
        generation's slots in order until its budget, ``--draft-p-min`` or the policy stops it."""
        for r in live:
            st = self._seqs.setdefault(r.seq, _Seq())
            n = len(r.context)
            if n - 1 < st.n_kv:  # the context is shorter than the cache (a caller's own context): cut back
                st.n_kv, st.pending, st.stale = n - 1, [], True
        self._inject([(r.seq, self._seqs[r.seq], len(r.context) - 1) for r in live])
        blocks = self.head.block([(r.seq, len(r.context) - 1, int(r.context[-1])) for r in live])
        for r, logits in zip(live, blocks):
            d = drafts[r.seq]
            for row in logits:
                if not self._take(r, d, row, t0):
                    break

    def _inject(self, items: list[tuple[int, _Seq, int]]) -> None:
        """Put each (seq, record, end)'s rows of positions up to ``end`` into the head's cache, in one call for all
        (split only by the batch size)."""
        entries = []
        for seq, st, end in items:
            if st.stale:
                self.head.truncate(seq, st.n_kv)
                st.stale = False
            first, rows = st.take(end, self.width)
            if rows is not None and len(rows):
                entries.append((seq, first, rows))
        if entries:
            self.head.inject(entries)

    def _take(self, r: DraftRequest, d: DraftChain, logits: np.ndarray, t0: float) -> bool:
        """Pick the next token from ``logits`` and offer it to ``r``'s draft; whether to draft one more."""
        tok, conf, q = self._pick(logits, r.budget.keep_going is not None)
        return d.take(tok, conf, q, r.budget, self.config.p_min, self.name, t0)



def check_head(meta: "GGUFInfo", head: Path | None, where: str = "--drafter dflash") -> Path:
    """Refuse, from GGUF metadata alone (milliseconds, before any load), a DFlash head that cannot draft for the
    target of ``meta``: none given, not a dflash GGUF (a DSpark head's Markov tensors need its anchor-first driver,
    which specstack has not), or a mismatch ``modelfile.compat.head_problems`` names (a layer past the target's,
    another hidden size or tokenizer, no mask token, a target graph without layer inputs: llama.cpp would refuse it
    at load, abort the process at the first call, or reject every block). One line, every mismatch in it; returns
    ``head``."""
    from ..modelfile.compat import HeadTarget, compare, head_problems
    from ..modelfile.meta import read_gguf

    if head is None:
        raise UnsupportedModelError(f"{where} drafts from a trained DFlash head: give it with -md HEAD.gguf (the head "
                                    "converted for this target, as llama.cpp's --spec-type draft-dflash reads it)")
    info = read_gguf(head, role="DFlash head")
    name = Path(head).name
    if info.head is None or info.head.kind != "dflash":
        what = ("a DSpark head (DFlash with Markov tensors), whose anchor-first blocks specstack does not draft; "
                "llama.cpp reads it with --spec-type draft-dspark" if info.head is not None and
                info.head.kind == "dspark" else f"{info.architecture!r}, not a DFlash head (general.architecture "
                "dflash); a draft model drafts with --drafter draft-model")
        raise UnsupportedModelError(f"{where}: -md {name} is {what}")
    problems = head_problems(HeadTarget.of(meta), info.head, name, compare(meta, info).verdict)
    if problems:
        raise UnsupportedModelError(f"{where}: -md {name} cannot draft for {Path(meta.path).name}: "
                                    + "; ".join(problems))
    return Path(head)


def _check_target(meta: "GGUFInfo", asked: Asked) -> Path:
    """``Needs.check``: the head given as ``draft_model`` (-md) fits the target (``check_head``); returns it."""
    return check_head(meta, asked.options.get("draft_model"), asked.where)


# llama.cpp's job of the same name: llama-server's --spec-type draft-dflash -md HEAD, and its
# llama-speculative-simple beside this drafter in the bench (the head is the bench's -md)
@register(NAME, needs=Needs(head=True, check=_check_target),
          llama=LlamaCpp(spec_types=("draft-dflash",), peers=("llama-draft-dflash",)))
def _build(ctx: BuildContext) -> Drafter:
    config = config_from_options(DFlashConfig, ctx.options)
    if not isinstance(ctx.target, LayerInputsTarget):
        raise UnsupportedModelError("--drafter dflash drafts from a loaded target's layer inputs (not a replay)")
    head = check_head(ctx.target.meta, config.draft_model)  # the metadata it was loaded from: not read again
    return DFlashDrafter(ctx.target, ctx.temperature, replace(config, draft_model=head))
