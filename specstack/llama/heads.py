"""Trained draft heads on a context of their own beside the target: llama.cpp's ``eagle3`` architecture.

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

The head's KV follows the target's sequences: ``truncate``/``reset``/``copy`` per sequence, as ``MtpContext``'s.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ModelLoadError, UnsupportedModelError
from .backend import ext_module, head_api
from .mtp import MtpContext, MtpHost


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
        lc = self._lc = target.lc
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"EAGLE-3 head {path} does not exist")
        self.target = target
        self._own_model = self._load(path)
        self.chained = False
        self.n_heads = 1
        api = head_api()
        n_ids = int(api.model_target_layer_ids_n(self._own_model))
        if n_ids != 3:  # llama.cpp's driver throws here: a head of another architecture
            self.close()
            raise UnsupportedModelError(f"{path.name} names {n_ids} target layers, not an EAGLE-3 head's 3 "
                                        "(general.architecture eagle3)")
        ids = api.model_target_layer_ids(self._own_model)
        self.target_layers = tuple(int(ids[i]) for i in range(n_ids))
        self.n_embd = int(lc.llama_model_n_embd(self._own_model))
        self.n_embd_tgt = int(lc.llama_model_n_embd(target.model))
        self.n_embd_enc = n_ids * self.n_embd_tgt
        self.n_vocab = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._own_model)))
        self.n_seq = target.n_slots
        self._ctx = lc.llama_init_from_model(self._own_model, self._draft_params(target, None))  # the default type
        if not self._ctx:
            self.close()
            raise ModelLoadError(f"llama.cpp could not create a context for the EAGLE-3 head {path.name} over "
                                 f"{target.name}")
        self._setup(int(lc.llama_n_batch(self._ctx)))
        self._setup_encoder()

    def _load(self, path: Path):
        lc = self._lc
        params = lc.llama_model_default_params()
        params.load_mode = 1 if self.target.use_mmap else 0  # LLAMA_LOAD_MODE_MMAP / _NONE, as the target's
        model = lc.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise ModelLoadError(f"llama.cpp could not load the EAGLE-3 head {path} (corrupt or unsupported GGUF?)")
        return model

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
