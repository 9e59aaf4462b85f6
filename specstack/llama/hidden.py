"""The target's hidden rows: what drafters that condition on the target read (``types.HiddenRows``).

With ``want_hidden()`` a ``LlamaModel`` asks llama.cpp for the row its NextN (MTP) head reads at every token of
every call (``llama_set_embeddings_nextn(ctx, true, masked=false)``: the post-final-norm state, ``t_h_nextn``),
and keeps them per sequence, by position, until the engine takes them (``take_hidden``). A cut (truncate,
reset, a loaded copy) drops the rows past it, so rows of rejected drafts never leave the target.

Exactness: unmasked rows make llama.cpp compute the last layer for every row of a call. The logits of a call
that outputs every row (a verification under exact shapes) or none (a prefill chunk, whose KV is computed
before any pruning) are bitwise those of plain decoding; a call that outputs some rows only (``--exact off``)
may differ in the last bits, which that mode allows (``tests/test_mtp.py`` measures both).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..types import HiddenRows
from .backend import ext_module


class HiddenStates:
    """``LlamaModel``'s hidden-row staging (a mixin: it uses the model's context)."""

    _lc: Any
    _ctx: Any
    _model: Any
    _staged: dict[int, tuple[int, list[np.ndarray]]] | None = None  # seq -> (start position, row blocks)
    n_embd_out: int = 0

    def want_hidden(self) -> None:
        """From now on keep every call's hidden rows (``take_hidden``); needs a model with NextN layers loaded."""
        if self._staged is not None:
            return
        ext_module().llama_set_embeddings_nextn(self._ctx, True, False)
        self.n_embd_out = int(self._lc.llama_model_n_embd_out(self._model))
        self._staged = {}

    @property
    def keeps_hidden(self) -> bool:
        return self._staged is not None

    def _stage_hidden(self, entries: list[tuple[int, int, int, int]], n_rows: int) -> None:
        """After a call of ``n_rows``: per (seq, first position, tokens, rows with pads) the rows of its tokens."""
        ptr = ext_module().llama_get_embeddings_nextn(self._ctx)
        if not ptr:
            return
        rows = np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_embd_out))
        at = 0
        for seq, pos, n, width in entries:
            self._put(seq, pos, rows[at : at + n].copy())
            at += width

    def _put(self, seq: int, pos: int, block: np.ndarray) -> None:
        staged = self._staged
        assert staged is not None
        start, blocks = staged.get(seq, (pos, []))
        end = start + sum(len(b) for b in blocks)
        if not blocks or pos > end or pos < start:  # a gap (or a rewrite before the first row): start again here
            staged[seq] = (pos, [block])
            return
        if pos < end:  # rewritten positions (a recurrent re-decode): the new rows replace the old
            self._cut_hidden(seq, pos)
            start, blocks = staged.get(seq, (pos, []))
        blocks.append(block)
        staged[seq] = (start, blocks)

    def _cut_hidden(self, seq: int, n_keep: int) -> None:
        """Forget rows at positions >= ``n_keep`` (a truncate, a rejected draft)."""
        staged = self._staged
        if staged is None or seq not in staged:
            return
        start, blocks = staged[seq]
        if n_keep <= start:
            del staged[seq]
            return
        kept, at = [], start
        for b in blocks:
            if at >= n_keep:
                break
            kept.append(b[: n_keep - at])
            at += len(b)
        staged[seq] = (start, kept)

    def _drop_hidden(self, seq: int | None = None) -> None:
        if self._staged is None:
            return
        if seq is None:
            self._staged.clear()
        else:
            self._staged.pop(seq, None)

    def take_hidden(self, seq: int) -> HiddenRows | None:
        """The rows kept for ``seq`` since the last take (None: none kept, or hidden rows are off)."""
        if self._staged is None or seq not in self._staged:
            return None
        start, blocks = self._staged.pop(seq)
        if not blocks:
            return None
        rows = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
        return HiddenRows(start, rows)
