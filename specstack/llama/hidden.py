"""The target's hidden rows: what drafters that condition on the target read (``types.HiddenRows``).

With ``want_hidden()`` a ``LlamaModel`` asks llama.cpp for the row its NextN (MTP) head reads at every token of
every call (``llama_set_embeddings_nextn(ctx, true, masked=false)``: the post-final-norm state, ``t_h_nextn``),
and keeps them per sequence, by position, until the engine takes them (``take_hidden``). A cut (truncate,
reset, a loaded copy) drops the rows past it, so rows of rejected drafts never leave the target.

Exactness: unmasked rows make llama.cpp compute the last layer for every row of a call. The logits of a call
that outputs every row (a verification under exact shapes) or none (a prefill chunk, whose KV is computed
before any pruning) are bitwise those of plain decoding; a call that outputs some rows only (``--exact off``)
may differ in the last bits, which that mode allows (``tests/test_mtp.py`` measures both).

With ``want_hidden(layers)`` it keeps instead, per token, the inputs of the target layers a trained head (EAGLE-3,
DFlash) names, side by side: ``[L_a | L_b | L_c]`` (``llama_set_embeddings_layer_inp``; id i is the residual stream
entering block i, id 0 the token embeddings). These are taken before the last layer's output pruning and only mark
extra graph outputs, so the logits stay bitwise those of plain decoding in every mode (``tests/test_layer_inputs.py``).
A target whose graph does not export layer inputs, or an id past its layers, would abort the process inside
llama.cpp: both are refused here first.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidParameterError, UnsupportedModelError
from ..modelfile.archs import exports_layer_inputs
from ..modelfile.meta import GGUFInfo
from ..types import HiddenRows
from .backend import ext_module, head_api


class HiddenStates:
    """``LlamaModel``'s hidden-row staging (a mixin: it uses the model's context)."""

    _lc: Any
    _ctx: Any
    _model: Any
    path: Path
    meta: GGUFInfo
    _staged: dict[int, tuple[int, list[np.ndarray]]] | None = None  # seq -> (start position, row blocks)
    n_embd_out: int = 0

    _layers: tuple[int, ...] = ()  # the layer ids whose inputs are kept; () keeps the NextN row

    def want_hidden(self, layers: tuple[int, ...] | None = None) -> None:
        """From now on keep every call's hidden rows (``take_hidden``): the NextN row (None; needs a model with NextN
        layers loaded) or the inputs of target ``layers``, side by side (a trained head's ``target_layers``).

        Raises ``UnsupportedModelError`` for a target whose graph exports no layer inputs and
        ``InvalidParameterError`` for an id past its layers (llama.cpp would abort the process on either), or for
        other layers than a channel already open."""
        wanted = () if layers is None else tuple(int(i) for i in layers)
        if self._staged is not None:
            if wanted != self._layers:
                raise InvalidParameterError(f"{self.path.name} already keeps {_channel(self._layers)}; one target "
                                            f"keeps one kind of hidden row, not also {_channel(wanted)}")
            return
        if wanted:
            self._check_layers(wanted)
            api = head_api()
            for lid in wanted:
                api.set_embeddings_layer_inp(self._ctx, lid, True)
            self.n_embd_out = len(wanted) * int(self._lc.llama_model_n_embd(self._model))
        else:
            ext_module().llama_set_embeddings_nextn(self._ctx, True, False)
            self.n_embd_out = int(self._lc.llama_model_n_embd_out(self._model))
        self._layers = wanted
        self._staged = {}

    def _check_layers(self, layers: tuple[int, ...]) -> None:
        """What llama.cpp asserts (and so aborts the process on) when a layer input is asked for, checked first: the
        target's graph exports layer inputs (``modelfile.archs.LAYER_INPUT_ARCHS``), each id is one of its layers."""
        arch = self.meta.architecture
        if not exports_layer_inputs(arch):
            raise UnsupportedModelError(f"{self.path.name} is {arch}, whose graph in this llama.cpp exports no layer "
                                        "inputs, so no EAGLE-3 or DFlash head can read it; use a target whose "
                                        "architecture does (llama, qwen3, qwen35, gemma4, gpt-oss, ...) or "
                                        "--drafter mtp / draft-model")
        n_layer = int(self._lc.llama_model_n_layer(self._model))
        bad = [i for i in layers if not 0 <= i < n_layer]
        if bad or len(set(layers)) != len(layers):
            raise InvalidParameterError(f"layer ids {', '.join(map(str, layers))}: {self.path.name} has {n_layer} "
                                        f"layers, so each id must be one of 0..{n_layer - 1}, each once; use the "
                                        "target the head was trained for")

    @property
    def keeps_hidden(self) -> bool:
        return self._staged is not None

    def _stage_hidden(self, entries: list[tuple[int, int, int, int]], n_rows: int) -> None:
        """After a call of ``n_rows``: per (seq, first position, tokens, rows with pads) the rows of its tokens."""
        rows = self._layer_rows(n_rows) if self._layers else self._nextn_rows(n_rows)
        if rows is None:
            return
        at = 0
        for seq, pos, n, width in entries:
            self._put(seq, pos, rows[at : at + n] if len(entries) > 1 or n != n_rows else rows)
            at += width

    def _nextn_rows(self, n_rows: int) -> np.ndarray | None:
        ptr = ext_module().llama_get_embeddings_nextn(self._ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_embd_out)).copy() if ptr else None

    def _layer_rows(self, n_rows: int) -> np.ndarray | None:
        """Each kept layer's inputs of the last call side by side, ``[L_a | L_b | L_c]`` per row in batch order (a
        copy: the next call overwrites llama.cpp's buffers). One memmove per layer into a layer-major block, then
        one transposing copy where the call had several rows: on pycoder-6m's 0.5 ms decode step the numpy views
        this replaced cost ~20 us a call, the staging a plain step pays for a head that may draft later."""
        get, n_ids = head_api().get_embeddings_layer_inp, len(self._layers)
        n_embd = self.n_embd_out // n_ids
        block = np.empty((n_ids, n_rows, n_embd), np.float32)
        nbytes, base = n_rows * n_embd * 4, block.ctypes.data
        for i, lid in enumerate(self._layers):
            ptr = get(self._ctx, lid)
            if not ptr:
                return None
            ctypes.memmove(base + i * nbytes, ptr, nbytes)
        return block.reshape(1, n_ids * n_embd) if n_rows == 1 else \
            np.ascontiguousarray(block.transpose(1, 0, 2)).reshape(n_rows, n_ids * n_embd)

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


def _channel(layers: tuple[int, ...]) -> str:
    return f"the inputs of layers {', '.join(map(str, layers))}" if layers else "the NextN row"
