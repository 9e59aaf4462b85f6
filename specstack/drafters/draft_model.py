"""Draft model: a second, smaller GGUF on its own llama.cpp context proposes tokens.

Its KV cache follows the committed tokens: before each proposal it drops
what diverged (rejected drafts) and evaluates only the tokens it has not
seen (usually the last one or two), never re-prefilling from scratch.
Drafting stops early when the draft's confidence falls below ``p_min``
(llama.cpp's --draft-p-min).  At temperature 0 drafts are argmax (q=None);
otherwise tokens are sampled at ``draft_temp`` and q is returned for
rejection sampling, which keeps the output distribution the target's.

Several generations share one draft context, one sequence each, and are
drafted in lockstep batches.

Example: after drafting ``x, y`` the draft KV holds ``[a, b, c, x]`` (the
last drafted token is never evaluated).  The target accepts ``x`` and then
emits ``z``, so the context is ``[a, b, c, x, z]``: the drafter keeps its KV,
evaluates just ``[z]`` and drafts from those logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import ModelLoadError, UnsupportedModelError, VocabMismatchError
from ..paths import DEFAULT_DRAFT
from ..sampling import sample, softmax
from ..llama import LlamaModel, ModelConfig, Segment
from ..modelfile.archs import DRAFTED_HEADS
from ..types import Draft
from .base import (Asked, BuildContext, DraftChain, Drafter, DraftRequest, LlamaCpp, ModelDraftConfig, Needs,
                   config_from_options, register)

if TYPE_CHECKING:
    from ..modelfile.meta import GGUFInfo

NAME = "draft-model"  # its registry name, for those that name it (default method lists, messages)


@dataclass(frozen=True)
class DraftModelConfig(ModelDraftConfig):
    """draft_model: GGUF path; draft_threads: 0 = the target's; sampling as ``ModelDraftConfig``."""

    draft_model: Path = DEFAULT_DRAFT
    draft_threads: int = 0  # 0 = same as the target


# A probe's draft reads at most this many tokens of context it has not seen (``DraftModelDrafter._sync``).
PROBE_CONTEXT = 32


@dataclass
class _Seq:
    """What the draft context holds for one generation."""

    cached: list[int] = field(default_factory=list)  # tokens in its KV cache, in order
    start: int = 0  # the context position of cached[0]: past 0 after a probe drafted from a window
    synced: int = 0  # prefix of ``cached`` known to equal the committed context


class DraftModelDrafter:
    """Proposes by running a small model autoregressively, one token per forward pass.

    One draft context serves every generation (one sequence each); a step's
    requests are drafted in lockstep, one batched forward pass per draft
    position.  Tokens committed while a generation did not draft are caught
    up lazily, in that same batch, when it drafts again: steps that do not
    draft cost the draft model nothing.
    """

    name = NAME

    def __init__(self, model: LlamaModel, temperature: float, config: DraftModelConfig, target_vocab: int | None = None) -> None:
        self.model = model
        # A "compatible" draft may have more ids than the target (extra control tokens):
        # it must never propose those, and q must be over the target's vocabulary.
        self.n_vocab = target_vocab or model.n_vocab
        self.config = config
        self.temperature = config.draft_temp if config.draft_temp is not None else temperature
        self.sampled = temperature > 0.0 and self.temperature > 0.0  # drafts are sampled (a translating drafter asks)
        self._rng = np.random.default_rng(None if config.seed is None or config.seed < 0 else config.seed + 1)
        self._seqs: dict[int, _Seq] = {}
        self._tli: tuple[np.ndarray, np.ndarray, int] | None = None  # see restrict_to()

    def restrict_to(self, draft_to_target: np.ndarray, target_vocab: int) -> None:
        """Token-level intersection (TLI, Timor et al. 2025) for a draft with another vocabulary.

        Sampled drafts come only from draft tokens whose text is one target
        token (``draft_to_target[d] >= 0``), from q renormalised over them, and
        q is returned over the *target's* vocabulary, so standard rejection
        sampling against the target stays exact.
        """
        allowed = np.flatnonzero(draft_to_target >= 0)
        self._tli = (allowed, draft_to_target[allowed], target_vocab)

    def begin(self, prompt_ids: Sequence[int], seq: int = 0) -> None:
        """The draft reads the prompt now (all but its last token, which a draft evaluates), as llama.cpp's draft
        context does: prompt processing, timed with the target's prefill. Drafts while decoding then catch up only
        on the tokens committed since the last one. Read at the first real draft instead, it was a spike inside
        decoding: 350 prompt tokens through pycoder-1m cost 11.6 ms, ten of pycoder-6m's plain steps, and the
        cost policy's first look at a prompt where drafting did not pay cost it that much (a tenth of the
        target's own prefill of those tokens, which the read now adds to the time to first token).

        What the sequence's cache holds of this prompt from the slot's last request (a conversation's earlier
        turns) is kept, as the target keeps its prefix: only the rest is read."""
        head = [int(t) for t in prompt_ids[:-1]]
        st = self._seqs.get(seq)
        keep = 0
        if st is not None and st.start == 0 and not self.model.is_recurrent:  # (a recurrent state cannot go back)
            st.synced = 0  # what it matched was the last request's context
            keep = self._kept(st, prompt_ids)
        if keep:
            self.model.truncate(keep, seq)
            del st.cached[keep:]
        else:
            self.model.reset(seq)
            st = _Seq()
        self._seqs[seq] = st
        if len(head) > keep:
            self._eval({seq: head[keep:]})
        st.synced = len(head)

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0) -> None:
        pass  # the next propose() re-syncs against the context

    def end(self, seq: int = 0, complete: bool = True) -> None:
        """A finished generation's cache stays for the slot's next prompt (``begin`` keeps what it shares); a
        cancelled one's goes."""
        if not complete and self._seqs.pop(seq, None) is not None:
            self.model.reset(seq)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        t0 = time.perf_counter()
        live = [r for r in requests if r.budget.max_tokens > 0]
        drafts = {r.seq: DraftChain() for r in live}
        logits = self._sync(live)
        for r in live:  # a recurrent draft model comes back here after a rejection (``recurrent``)
            self.model.protect(r.seq, r.budget.max_tokens, one_call=False)
        while live:
            going: list[DraftRequest] = []
            for r in live:
                tok, conf, q = self._pick(logits[r.seq], r.budget.keep_going is not None)
                if drafts[r.seq].take(tok, conf, q, r.budget, self.config.p_min, self.name, t0):
                    going.append(r)
            live = going
            if live:
                logits = self._eval({r.seq: [drafts[r.seq].tokens[-1]] for r in live})
        return [drafts[r.seq].draft(self.name) if r.seq in drafts else Draft.empty(self.name) for r in requests]

    def _sync(self, requests: Sequence[DraftRequest]) -> dict[int, np.ndarray]:
        """Make each sequence's KV equal its ``context[:-1]``, evaluate the rest; return last logits.

        A probe (``Budget.probe``: the policy only wants to learn whether drafting pays) never catches up on
        more than ``PROBE_CONTEXT`` tokens: behind by more (plain steps since the last draft, or a context
        ``begin`` did not read), it drafts from the context's last ``PROBE_CONTEXT`` tokens alone. Real drafts
        catch up in full (after a probe's window, on the whole context again).
        """
        todo: dict[int, list[int]] = {}
        for r in requests:
            st = self._seqs.setdefault(r.seq, _Seq())
            ctx, n = r.context, len(r.context)
            i = self._kept(st, ctx)
            if r.budget.probe and n - i > PROBE_CONTEXT:
                self.model.reset(r.seq)
                st.cached, st.start, st.synced = [], n - PROBE_CONTEXT, n
                todo[r.seq] = [int(t) for t in ctx[st.start:]]
                continue
            if st.start > 0 and not r.budget.probe:  # a probe's window: a real draft reads the whole context
                self.model.reset(r.seq)
                st.cached, st.start, i = [], 0, 0
            elif i - st.start < len(st.cached):
                self.model.truncate(i - st.start, r.seq)
                del st.cached[i - st.start:]
            st.synced = n
            todo[r.seq] = [int(t) for t in ctx[i:]]
        return self._eval(todo) if todo else {}

    @staticmethod
    def _kept(st: _Seq, ctx: Sequence[int]) -> int:
        """How many tokens of ``ctx`` the sequence's KV holds that are still right (from ``st.start``), always
        leaving the last token to evaluate."""
        cached, start = st.cached, st.start
        limit = max(0, min(len(cached), len(ctx) - 1 - start))
        i = min(max(st.synced - start, 0), limit)
        while i < limit and cached[i] == ctx[start + i]:
            i += 1
        return start + i

    def _eval(self, tokens: dict[int, list[int]]) -> dict[int, np.ndarray]:
        """One batched forward pass; the last row of logits per sequence (copied)."""
        segments = [Segment(seq, toks, logits_from=len(toks) - 1) for seq, toks in tokens.items()]
        rows = self.model.decode(segments)
        for seq, toks in tokens.items():
            self._seqs[seq].cached.extend(toks)
        return {s.seq: r[-1] for s, r in zip(segments, rows)}

    def _pick(self, logits: np.ndarray, need_conf: bool) -> tuple[int, float, np.ndarray | None]:
        """(token, confidence, q row or None).  Confidence is the draft's probability of its token."""
        logits = logits[: self.n_vocab]
        if not self.sampled:
            tok = int(logits.argmax())
            if self.config.p_min <= 0.0 and not need_conf:
                return tok, 1.0, None
            conf = float(1.0 / np.exp(logits.astype(np.float64) - logits[tok]).sum())
            return tok, conf, None
        q = softmax(logits[None, :], self.temperature)[0]
        if self._tli is not None:
            allowed, to_target, target_vocab = self._tli
            q_in = q[allowed]
            q_in = q_in / q_in.sum()
            i = sample(q_in, self._rng)
            qt = np.zeros(target_vocab, dtype=np.float64)
            np.add.at(qt, to_target, q_in)
            return int(allowed[i]), float(q_in[i]), qt
        if q.shape[0] < self.n_vocab:  # a smaller draft vocabulary: the target's extra ids get q = 0
            q = np.pad(q, (0, self.n_vocab - q.shape[0]))
        tok = sample(q, self._rng)
        return tok, float(q[tok]), q



def _load_draft(ctx: BuildContext, config: DraftModelConfig) -> LlamaModel:
    """The draft GGUF on its own context: one sequence per target slot, in one shared cache, warmed up."""
    model = _open_draft(ctx, config)
    _warm_up(model)
    return model


def _warm_up(model: LlamaModel) -> None:
    """One throw-away call at load, as llama.cpp's common_init warms up its models: a context's first call
    allocates its buffers and graphs, a spike the cost policy would otherwise charge to the first draft."""
    bos = model.bos_id if 0 <= model.bos_id < model.n_vocab else 0
    model.decode([Segment(0, [bos, bos], logits_from=1)])
    model.reset(0)


def _open_draft(ctx: BuildContext, config: DraftModelConfig) -> LlamaModel:
    return LlamaModel(
        ModelConfig(
            path=Path(config.draft_model),
            n_ctx=ctx.target.n_ctx,
            ctx_origin=_ctx_origin(ctx.target),
            n_threads=config.draft_threads or ctx.target.n_threads,
            min_batch=1,  # draft logits need not be batch-invariant
            exact=False,
            n_slots=ctx.target.n_slots,
            unified=True,  # one shared cache: drafts need no exact cell layout
        ),
        role="draft model",
    )


def _ctx_origin(target: object) -> str:
    """The draft's context (the target's), as a warning should name it: a draft trained on fewer positions was
    warned about a ``--ctx-size 4096`` that was llama.cpp's default, never given."""
    target_config = getattr(target, "config", None)
    given = target_config is not None and getattr(target_config, "n_ctx", None) is not None
    how = "as -c set it" if given else "the default; -c sets it"
    return f"its context, the target's {target.n_ctx} positions per sequence ({how}),"  # type: ignore[attr-defined]


def _check_target(meta: "GGUFInfo", asked: Asked) -> None:
    """``Needs.check``: the draft given (-md, a role's draft) is a model, not a trained draft head (eagle3, dflash):
    a head reads the target's layer inputs and cannot draft on its own; llama.cpp would fail to make a context for
    it after the target's load. One line, from its metadata, naming the drafter that reads it."""
    from ..modelfile.meta import read_gguf

    draft = asked.options.get("draft_model")
    if draft is None:
        return
    try:
        head = read_gguf(draft, role="draft model (-md)").head  # tensor infos: dspark is dflash with Markov tensors
    except ModelLoadError:
        return  # not a readable GGUF: the draft's own file check, next, says so in its words
    if head is not None:
        reads = f"--drafter {head.kind} (llama-server's --spec-type draft-{head.kind}) drafts from it" \
            if head.kind in DRAFTED_HEADS else "specstack cannot draft from it yet"
        raise UnsupportedModelError(f"{asked.where}: -md {Path(draft).name} is a trained {head.kind} head, not a model "
                                    f"to draft with: a head reads the target's layer inputs; {reads}")


# llama.cpp's speculation with a draft model (-md): --spec-type draft-simple
@register(NAME, needs=Needs(draft_model=True, check=_check_target),
          llama=LlamaCpp(spec_types=("draft-simple",), peers=("llama-draft-simple",)))
def _build(ctx: BuildContext) -> Drafter:
    """A draft model; one whose vocabulary differs from the target's drafts through text (``translate``)."""
    from ..modelfile.compat import TRANSLATABLE, require_draftable

    config = config_from_options(DraftModelConfig, ctx.options)
    report = require_draftable(ctx.target.path, config.draft_model)
    if report.verdict != TRANSLATABLE:
        return DraftModelDrafter(_load_draft(ctx, config), ctx.temperature, config, target_vocab=ctx.target.n_vocab)
    from .translate import TranslatingDrafter

    if not isinstance(ctx.target, LlamaModel):
        raise VocabMismatchError(f"{config.draft_model} has another vocabulary than the target; translating its "
                                 "drafts needs the target's tokenizer, so a loaded target (not a replay)")
    draft = _load_draft(ctx, config)
    return TranslatingDrafter(DraftModelDrafter(draft, ctx.temperature, config), ctx.target, draft)
