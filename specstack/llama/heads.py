"""Trained draft heads on a context of their own beside the target: llama.cpp's ``eagle3`` and ``dflash`` architectures.

An EAGLE-3 head (docs/design-eagle3-dflash.md, sections 1-3) is a separate GGUF (``general.architecture`` eagle3)
that reads three of the target's layer inputs per token (``HiddenStates.want_hidden(layers)``). llama.cpp runs it
as an encoder-decoder model on a context whose ``ctx_other`` is the target's context (the head borrows the target's
token embeddings and, without a reduced vocabulary, its output matrix; the context refuses to open without it):

- the encoder (``encode``): feature rows ``[L_a | L_b | L_c]`` (``3 * n_embd_tgt`` floats) through ``fc`` give one
  row g per token (``n_embd`` of the head), read from the context's NextN output as llama.cpp's driver reads it;
- the decoder (``run``): at head-KV position P the pair ``(x_{P+1}, g_P)``: a token and a row, as an MTP head's
  pairs are, so the calls are ``MtpContext``'s own (a classic ``llama_batch`` carrying both token and row, since
  ``llama_batch_ext_set_embd_state`` is a stub). Each output row gives the logits (always ``n_vocab`` wide: a head
  with its own reduced vocabulary scatters its rows through ``d2t`` in the graph, ``-inf`` elsewhere) and the
  pre-norm row that a chained draft step feeds back as the next g.

A DFlash head (``general.architecture`` dflash, plain DFlash: no Markov tensors) reads any number of the target's
layer inputs per token and drafts a whole block in one call (``DFlashContext``), on the same kind of context:

- ``inject``: feature rows ``[L_a | L_b | ...]`` at the target's positions, an embedding-only batch: the graph projects
  them (``fc``, a norm) and writes each layer's K/V of them straight into the head's cache (no attention, no output);
- ``block``: per sequence the token batch ``[x_last, MASK x (L-1)]`` at the positions from the last committed token's
  on, with non-causal attention (``llama_set_causal_attn(ctx, false)``, as llama.cpp's driver sets it): every block
  row attends to the injected context and to the whole block, and slot i >= 1 predicts the token i positions after
  ``x_last``. Its rows are cut from the cache right after the call, so the cache holds the injected context only.

The head's KV follows the target's sequences: ``truncate``/``reset``/``copy`` per sequence, as ``MtpContext``'s.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import ModelLoadError, UnsupportedModelError
from .backend import ext_module, head_api
from .mtp import MtpContext, MtpHost


def _load_head(target: MtpHost, path: Path, what: str):
    """The head GGUF at ``path`` loaded as the target was (mmap or not); a head needs no NextN layers loaded."""
    lc = target.lc
    params = lc.llama_model_default_params()
    params.load_mode = 1 if target.use_mmap else 0  # LLAMA_LOAD_MODE_MMAP / _NONE, as the target's
    model = lc.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ModelLoadError(f"llama.cpp could not load the {what} {path} (corrupt or unsupported GGUF?)")
    return model


def _open_head(ctx: MtpContext, target: MtpHost, path: Path) -> Any:
    """What an EAGLE-3 and a DFlash context set up alike: the head GGUF loaded beside ``target`` (``_load_head``), the
    fields ``MtpContext``'s calls read, the head's target layer ids (``{arch}.target_layers``) and widths: a feature
    row is ``n_ids`` x the *target's* n_embd, as llama.cpp sizes it. Returns llama_cpp."""
    lc = ctx._lc = target.lc
    if not path.is_file():
        raise ModelLoadError(f"{ctx.what} {path} does not exist")
    ctx.target = target
    ctx._own_model = _load_head(target, path, ctx.what)
    ctx.chained = False
    ctx.n_heads = 1
    api = head_api()
    n_ids = int(api.model_target_layer_ids_n(ctx._own_model))
    ids = api.model_target_layer_ids(ctx._own_model) if n_ids else None
    ctx.target_layers = tuple(int(ids[i]) for i in range(n_ids))
    ctx.n_embd = int(lc.llama_model_n_embd(ctx._own_model))
    ctx.n_embd_tgt = int(lc.llama_model_n_embd(target.model))
    ctx.n_embd_enc = n_ids * ctx.n_embd_tgt
    ctx.n_vocab = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(ctx._own_model)))
    ctx.n_seq = target.n_slots
    return lc


class Eagle3Context(MtpContext):
    """An EAGLE-3 head GGUF loaded beside ``target`` (``LlamaModel.open_eagle3``): one sequence per target slot in
    one unified KV cache (drafts need no exact cell layout). ``target_layers``: the target layer ids whose inputs
    the encoder reads, in the order it reads them; ``n_embd_enc``: the width of a feature row."""

    # eagle3.cpp builds no output-row selection (``inp_out_ids``): its logits and pre-norm rows come for every row of a
    # call, and llama.cpp copies the first n_outputs of them, so a call with one output among several rows read
    # the first row's (llama.cpp's own driver never asks so: one output row per sequence a call)
    outputs_all = True
    what = "EAGLE-3 head"

    def __init__(self, target: MtpHost, path: Path) -> None:  # noqa: D107 (MtpContext's setup, another model)
        path = Path(path)
        lc = _open_head(self, target, path)
        if len(self.target_layers) != 3:  # llama.cpp's driver throws here: a head of another architecture
            self.close()
            raise UnsupportedModelError(f"{path.name} names {len(self.target_layers)} target layers, not an EAGLE-3 "
                                        "head's 3 (general.architecture eagle3)")
        self._ctx = lc.llama_init_from_model(self._own_model, self._draft_params(target, None))  # the default type
        if not self._ctx:
            self.close()
            raise ModelLoadError(f"llama.cpp could not create a context for the EAGLE-3 head {path.name} over "
                                 f"{target.name}")
        self._setup(int(lc.llama_n_batch(self._ctx)))
        self._setup_encoder()

    def _setup_encoder(self) -> None:
        """The encoder's classic batch: feature rows only (no tokens), every row an output, all in sequence 0. The
        encoder reads and writes no KV, but llama.cpp still checks that a batch's positions continue sequence 0's
        cache: placeholders from there on, as llama.cpp's driver writes them."""
        lc = self._lc
        e = self._enc = lc.llama_batch_init(self.cap, self.n_embd_enc, 1)
        self._e_embd = np.ctypeslib.as_array(e.embd, shape=(self.cap, self.n_embd_enc))
        self._e_pos = np.ctypeslib.as_array(e.pos, shape=(self.cap,))
        np.ctypeslib.as_array(e.n_seq_id, shape=(self.cap,))[:] = 1
        np.ctypeslib.as_array(e.logits, shape=(self.cap,))[:] = 1
        for i in range(self.cap):
            e.seq_id[i][0] = 0
        self.encodes = 0

    def encode(self, features: np.ndarray) -> np.ndarray:
        """g rows ``[n, n_embd]`` of feature rows ``[n, n_embd_enc]`` (the target's ``[L_a | L_b | L_c]`` per token),
        in calls of at most the batch size."""
        lc = self._lc
        n = int(features.shape[0])
        out = np.empty((n, self.n_embd), np.float32)
        for at in range(0, n, self.cap):
            m = min(self.cap, n - at)
            self._e_embd[:m] = features[at : at + m]
            first = self.pos_max(0) + 1
            self._e_pos[:m] = np.arange(first, first + m, dtype=np.int32)
            self._enc.n_tokens = m
            rc = lc.llama_encode(self._ctx, self._enc)
            if rc != 0:
                raise ModelLoadError(f"llama_encode failed (code {rc}) on {m} rows of {self.target.name}'s EAGLE-3 head")
            g = ext_module().llama_get_embeddings_nextn(self._ctx)
            out[at : at + m] = np.ctypeslib.as_array(g, shape=(m, self.n_embd))
            self.encodes += 1
        return out

    def close(self) -> None:
        if getattr(self, "_enc", None) is not None:
            self._lc.llama_batch_free(self._enc)
            self._enc = None
        super().close()


class DFlashContext(MtpContext):
    """A DFlash head GGUF loaded beside ``target`` (``LlamaModel.open_dflash``): one sequence per target slot in one
    unified KV cache, as ``Eagle3Context``. Its calls are ``inject`` and ``block`` (module docstring), not MTP pairs;
    it shares ``MtpContext``'s setup over the target and its cache calls (``truncate``/``reset``/``copy``/
    ``save_seq``...). ``target_layers``: the target layer ids whose inputs a feature row holds, in order;
    ``block_size``: the rows of a block (``dflash.block_size``; llama.cpp's driver defaults to 16), so at most
    ``block_size - 1`` drafts a call; ``mask_id``: the token that fills a block's slots after the first."""

    what = "DFlash head"

    def __init__(self, target: MtpHost, path: Path) -> None:  # noqa: D107 (MtpContext's setup, another model)
        path = Path(path)
        lc = _open_head(self, target, path)
        n_ids = len(self.target_layers)
        self.block_size = _block_size(lc, self._own_model)
        self.mask_id = int(lc.llama_vocab_mask(lc.llama_model_get_vocab(self._own_model)))
        # llama.cpp's driver asserts on a head that names no layers, and without a mask token every block is rejected
        if n_ids == 0 or self.mask_id < 0 or self.block_size < 2:
            self.close()
            raise UnsupportedModelError(f"{path.name} is no DFlash head llama.cpp can draft with ({n_ids} target "
                                        f"layers, mask token {self.mask_id}, block size {self.block_size}): "
                                        "reconvert it with llama.cpp's convert_hf_to_gguf.py")
        # room for a block past a full context in every sequence: the block's rows sit in the cache during the call;
        # and a whole block in one call (its rows attend to each other)
        params = self._draft_params(target, None, (target.n_ctx + self.block_size) * self.n_seq)
        params.n_batch = params.n_ubatch = max(int(params.n_batch), self.block_size)
        self._ctx = lc.llama_init_from_model(self._own_model, params)
        if not self._ctx:
            self.close()
            raise ModelLoadError(f"llama.cpp could not create a context for the DFlash head {path.name} over "
                                 f"{target.name}")
        self._setup_batches(int(lc.llama_n_batch(self._ctx)))

    def _setup_batches(self, cap: int) -> None:
        """Two classic batches, since the graph picks its mode by the batch's kind: feature rows only (``embd``, no
        token ids) for ``inject``, token ids only for ``block``; the causal flag off for the blocks, and the NextN
        rows masked to outputs, as llama.cpp's driver sets them (plain DFlash has none)."""
        lc = self._lc
        ext_module().llama_set_embeddings_nextn(self._ctx, True, True)
        lc.llama_set_causal_attn(self._ctx, False)
        self._mem = lc.llama_get_memory(self._ctx)
        self.cap = cap
        e = self._inj = lc.llama_batch_init(cap, self.n_embd_enc, 1)
        t = self._blk = lc.llama_batch_init(cap, 0, 1)
        self._i_embd = np.ctypeslib.as_array(e.embd, shape=(cap, self.n_embd_enc))
        self._i_pos = np.ctypeslib.as_array(e.pos, shape=(cap,))
        self._t_tok = np.ctypeslib.as_array(t.token, shape=(cap,))
        self._t_pos = np.ctypeslib.as_array(t.pos, shape=(cap,))
        for b in (e, t):
            np.ctypeslib.as_array(b.n_seq_id, shape=(cap,))[:] = 1
        np.ctypeslib.as_array(e.logits, shape=(cap,))[:] = 0  # an injection outputs nothing
        np.ctypeslib.as_array(t.logits, shape=(cap,))[:] = 1  # no output-row selection in the graph: every row
        self._i_seq, self._t_seq = [0] * cap, [0] * cap  # each row's sequence as last written (few ctypes writes)
        for i in range(cap):
            e.seq_id[i][0] = t.seq_id[i][0] = 0
        self.injects = 0  # calls of each kind, for tests and profiles
        self.blocks = 0

    @staticmethod
    def _set_seqs(batch, written: list[int], at: int, n: int, seq: int) -> None:
        """Rows ``at..at+n`` of ``batch`` belong to ``seq``."""
        for i in range(at, at + n):
            if written[i] != seq:
                batch.seq_id[i][0] = seq
                written[i] = seq

    def inject(self, entries: Sequence[tuple[int, int, np.ndarray]]) -> None:
        """Write the K/V of feature rows into the cache: per (seq, first position, rows ``[n, n_embd_enc]``), at
        consecutive positions that continue what ``seq`` holds (llama.cpp checks it), in as few calls as the batch
        size allows (every row is independent of the others here, so a sequence's rows may split across calls)."""
        b, m = self._inj, 0
        for seq, pos, rows in entries:
            done = 0
            while done < len(rows):
                take = min(len(rows) - done, self.cap - m)
                self._i_embd[m : m + take] = rows[done : done + take]
                self._i_pos[m : m + take] = np.arange(pos + done, pos + done + take, dtype=np.int32)
                self._set_seqs(b, self._i_seq, m, take, seq)
                m, done = m + take, done + take
                if m == self.cap:
                    self._decode(b, m, "injecting")
                    m = 0
        if m:
            self._decode(b, m, "injecting")

    def block(self, entries: Sequence[tuple[int, int, int]]) -> list[np.ndarray]:
        """Per (seq, position of the last committed token, that token): the block ``[token, MASK x (block_size-1)]``
        from that position on; returns per entry the logits of slots 1..block_size-1 (``[block_size-1, n_vocab]``,
        copies; slot i predicts the token i positions after the given one). Whole blocks per call (a block split
        across calls would not see its own later rows); the block rows are cut from the cache after the call. The
        cache of each sequence must end just before the block's first position (llama.cpp checks it)."""
        lc, b, L = self._lc, self._blk, self.block_size
        per_call = max(1, self.cap // L)
        out: list[np.ndarray] = []
        for at in range(0, len(entries), per_call):
            part = entries[at : at + per_call]
            for j, (seq, pos, token) in enumerate(part):
                self._t_tok[j * L] = token
                self._t_tok[j * L + 1 : (j + 1) * L] = self.mask_id
                self._t_pos[j * L : (j + 1) * L] = np.arange(pos, pos + L, dtype=np.int32)
                self._set_seqs(b, self._t_seq, j * L, L, seq)
            m = len(part) * L
            self._decode(b, m, "drafting a block")
            logits = np.ctypeslib.as_array(lc.llama_get_logits(self._ctx), shape=(m, self.n_vocab))
            out += [logits[j * L + 1 : (j + 1) * L].copy() for j in range(len(part))]
            for seq, pos, _ in part:
                self.truncate(seq, pos)
        return out

    def _decode(self, batch, m: int, doing: str) -> None:
        batch.n_tokens = m
        rc = self._lc.llama_decode(self._ctx, batch)
        if rc != 0:
            raise ModelLoadError(f"llama_decode failed (code {rc}) {doing} ({m} rows) on {self.target.name}'s DFlash "
                                 "head")
        if batch is self._inj:
            self.injects += 1
        else:
            self.blocks += 1

    def close(self) -> None:
        for name in ("_inj", "_blk"):
            if getattr(self, name, None) is not None:
                self._lc.llama_batch_free(getattr(self, name))
                setattr(self, name, None)
        super().close()


def _block_size(lc, model) -> int:
    """``dflash.block_size`` of the head's metadata, or llama.cpp's driver's default of 16 where it has none."""
    buf = ctypes.create_string_buffer(32)
    if int(lc.llama_model_meta_val_str(model, b"dflash.block_size", buf, len(buf))) < 0:
        return 16
    return int(buf.value.decode() or 16)
