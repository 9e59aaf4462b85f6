"""Drafting with a model from another tokenizer: draft tokens -> text -> the target's tokens.

As in Hugging Face's universal assisted generation.  The draft model keeps
its own token context, the committed text tokenized with *its* tokenizer
(with its own BOS), kept in step incrementally: on new text the last two
draft tokens are taken back and the tail is tokenized again, so merges at
the boundary come out as a whole tokenization would make them.  Its draft
is turned into text and tokenized with the target's tokenizer together with
the last committed target tokens; only whole tokens after an unchanged
boundary are kept, and the last one is dropped (more text could still
merge into it).  Verification is an exact match against the target's own
tokens, so greedy output stays the target's.  With sampling, where enough
of the vocabularies overlap (``TLI_MIN_OVERLAP``), the draft samples only
tokens that exist in both vocabularies with the same text (token-level
intersection, Timor et al. 2025) and hands rejection sampling its
renormalised distribution over the target's ids; otherwise the translated
text is verified as a point mass.  Both are lossless.

Example: committed text ``"def f"``, draft (SentencePiece) ``["(x", "):"]``:
text ``"(x):"``; target-tokenized with the tail ``" f"`` as ``[" f", "(", "x", "):"]``;
the boundary ``" f"`` is unchanged, ``"):"`` is dropped as possibly
incomplete, so the draft is ``["(", "x"]`` in target ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

import numpy as np

from ..llama import LlamaModel
from ..types import Draft
from .base import Drafter, DraftRequest

BACKOFF = 2  # draft tokens re-tokenized at the boundary when new text arrives
TLI_MIN_OVERLAP = 0.5  # share of draft tokens with a same-text target token needed for TLI sampling
TAIL = 3  # committed target tokens tokenized again with the draft's text, to check the boundary


@dataclass
class _Text:
    """One generation's committed text and its tokenization in the draft's vocabulary."""

    n_target: int = 0  # committed target tokens turned into text so far
    data: bytearray = field(default_factory=bytearray)
    dtoks: list[int] = field(default_factory=list)  # draft tokens (BOS first if the draft wants one)
    covered: int = 0  # bytes of ``data`` the draft tokens spell


class RestrictableDrafter(Drafter, Protocol):
    """What a translating drafter wraps (``draft_model.DraftModelDrafter``, which builds it): a draft model's drafter
    that says whether it samples, and can be restricted to the tokens both vocabularies spell alike (TLI)."""

    sampled: bool

    def restrict_to(self, draft_to_target: np.ndarray, target_vocab: int) -> None: ...


class TranslatingDrafter:
    """Wraps a draft model whose vocabulary differs from the target's."""

    def __init__(self, inner: RestrictableDrafter, target: LlamaModel, draft: LlamaModel) -> None:
        self.inner, self.target, self.draft = inner, target, draft
        self.name = inner.name
        self._texts: dict[int, _Text] = {}
        self._bos = [draft.bos_id] if draft.add_bos and draft.bos_id >= 0 else []
        self.to_target: np.ndarray | None = None  # draft id -> target id with the same text (TLI), -1 if none
        if inner.sampled:
            to_target = intersection(target, draft)
            self.overlap = float((to_target >= 0).mean())
            if self.overlap >= TLI_MIN_OVERLAP:
                self.to_target = to_target
                inner.restrict_to(to_target, target.n_vocab)

    def begin(self, prompt_ids: Sequence[int], seq: int = 0) -> None:
        self._texts[seq] = _Text(dtoks=list(self._bos))
        self.inner.begin((), seq)  # the target's ids are not the draft's: the first propose translates the prompt

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0) -> None:
        pass  # the next propose() catches up from the context

    def end(self, seq: int = 0, complete: bool = True) -> None:
        self._texts.pop(seq, None)
        self.inner.end(seq, complete)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        asks = []
        for r in requests:
            dctx = self._draft_context(r.seq, r.context)
            # Draft tokens are shorter than target tokens about as often as longer: ask for one more,
            # the one the translation drops at the end.
            asks.append(DraftRequest(r.seq, dctx, replace(r.budget, max_tokens=r.budget.max_tokens + 1 if r.budget.max_tokens else 0,
                                                          tree=False)))
        drafts = self.inner.propose(asks)
        if self.to_target is not None:  # TLI: every draft token is one target token, q is over the target's ids
            return [Draft(tuple(int(self.to_target[t]) for t in d.token_ids[: r.budget.max_tokens]), self.name,
                          None if d.q is None else d.q[: r.budget.max_tokens]) for r, d in zip(requests, drafts)]
        return [self._translate(r.context, d, r.budget.max_tokens) for r, d in zip(requests, drafts)]

    def _draft_context(self, seq: int, context: Sequence[int]) -> list[int]:
        """The committed text, tokenized for the draft, updated from the last call."""
        st = self._texts.get(seq)
        if st is None or len(context) < st.n_target:  # new, or not a continuation: start over
            st = self._texts[seq] = _Text(dtoks=list(self._bos))
        for t in context[st.n_target :]:
            st.data += self.target.token_bytes(int(t))
        st.n_target = len(context)
        back = 0
        while len(st.dtoks) > len(self._bos) and back < BACKOFF:
            st.covered -= len(self.draft.token_bytes(st.dtoks.pop()))
            back += 1
        tail = bytes(st.data[st.covered :])
        if tail:
            st.dtoks.extend(self.draft.tokenize(tail, add_special=False))
            st.covered = len(st.data)
        return st.dtoks

    def _translate(self, context: Sequence[int], draft: Draft, budget: int) -> Draft:
        return Draft(tuple(translate(self.target, self.draft, context, draft.token_ids, budget)), self.name)


def intersection(target: LlamaModel, draft: LlamaModel) -> np.ndarray:
    """Draft id -> the target id whose text is byte for byte the same, or -1 (control tokens never match)."""
    by_text: dict[bytes, int] = {}
    for t in range(target.n_vocab):
        b = target.token_bytes(t)
        if b and not target.is_eog(t):
            by_text.setdefault(b, t)
    return np.array([by_text.get(draft.token_bytes(d), -1) if draft.token_bytes(d) else -1 for d in range(draft.n_vocab)],
                    dtype=np.int64)


def translate(target: LlamaModel, draft: LlamaModel, context: Sequence[int], draft_ids: Sequence[int], budget: int) -> list[int]:
    """Target token ids for the text of ``draft_ids`` following ``context`` (whole, stable tokens only)."""
    if not draft_ids or budget <= 0:
        return []
    text = b"".join(draft.token_bytes(int(t)) for t in draft_ids)
    tail = [int(t) for t in context[-TAIL:]]
    head = b"".join(target.token_bytes(t) for t in tail)
    ids = target.tokenize(head + text, add_special=False)
    if ids[: len(tail)] == tail:
        ids = ids[len(tail) :]
    else:  # the draft's text merges into the last committed token: translate it on its own
        ids = target.tokenize(text, add_special=False)
    return ids[: max(0, len(ids) - 1)][:budget]
