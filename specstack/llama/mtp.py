"""A target's multi-token-prediction (NextN) head on a context of its own: llama.cpp's draft-mtp draft context.

llama.cpp (the tree vendored in llama-cpp-python 0.3.36) runs a model's NextN layers on a second context over
the same loaded weights (``ctx_type = LLAMA_CONTEXT_TYPE_MTP``; its KV cache holds only the NextN layers).
Each row of an MTP call is a token *and* a hidden row: at position p the pair ``(x_p, h_{p-1})``, where
``h_{p-1}`` is the target's post-norm row at p-1 (``HiddenStates``; zeros at position 0) or, for a chained
draft step, the head's own output row. The head predicts ``x_{p+1}``.

Traps this module keeps callers out of (measured in issue 32's research):
- a model loaded without ``load_mtp`` still reports its NextN layers, and an MTP context on it aborts the
  process inside llama.cpp (``GGML_ASSERT(layer.nextn.eh_proj)``): ``MtpContext`` refuses such a target;
- ``llama_batch_ext_set_embd_state`` is a stub: rows go in through the classic ``llama_batch`` carrying both
  ``token`` and ``embd`` (llama.cpp's "MTP hook batches"), filled from numpy in one go;
- the MTP KV must follow the target's sequence: ``truncate``/``reset``/``copy`` per sequence.

Chained heads (step35: ``n_heads`` trained NextN blocks, one per draft position): the context runs the head
``llama_set_nextn_layer_offset`` selects (``run(..., head=i)``), each head with its own layer's KV in the same
cells. As llama.cpp's driver does, every catch-up runs every head on the same rows (``catch_up``), each after the
rows' positions are removed (cell metadata is shared by the layers: a re-added position takes the freed cell
back, keeping the other heads' K/V there).

Assistant (gemma4): the head is a separate GGUF (``gemma4-assistant``) loaded here, whose context is created with
``ctx_other`` = the target's context, as llama.cpp's ``common_speculative_init_result`` does. Its attention has no
K/V of its own: it reads the target's KV cache (``shared``), so there is nothing to catch up and nothing to cut
(llama.cpp makes every memory call on it a no-op); its context mirrors the target's (cells, sequences, streams).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import ModelLoadError, UnsupportedModelError
from .backend import ext_module


@dataclass(frozen=True)
class MtpHost:
    """What an MTP context reads of the loaded model it drafts for (``LlamaModel.open_mtp`` fills it in): its
    llama.cpp handles, and the settings the head's context copies."""

    lc: Any  # the llama_cpp module
    model: Any  # llama_model*: the weights, NextN layers included where loaded
    ctx: Any  # llama_context*: the target's context (the assistant reads its KV)
    name: str  # the model file's name, for messages
    architecture: str
    mtp_mode: str | None  # which MTP graph this llama.cpp has for the architecture (``GGUFInfo.mtp_mode``)
    n_nextn: int
    mtp_loaded: bool
    n_vocab: int
    n_slots: int
    n_ctx: int  # per slot
    n_batch: int
    n_threads: int
    flash_attn: bool
    unified: bool
    use_mmap: bool


@dataclass
class MtpRow:
    """One generation's rows in an MTP call: ``tokens`` at positions ``pos``.., each with its h row (``h``:
    [len(tokens), n_embd]); ``output``: return the head's logits and h row at the last one."""

    seq: int
    pos: int
    tokens: Sequence[int]
    h: np.ndarray
    output: bool = False


class MtpContext:
    """The NextN head of ``target`` (loaded with its NextN layers), one sequence per target slot, one shared
    (unified) KV cache: drafts need no exact cell layout."""

    shared = False  # the assistant mode: the head reads the target's KV (module docstring)
    # A graph that prunes no rows to the outputs asked for (eagle3): llama.cpp then reads a call's logits and rows
    # from the first rows of the graph's outputs, so a call that wants any output marks every row as one.
    outputs_all = False
    what = "MTP head"  # in messages
    _own_model = None  # the assistant's loaded model, freed with this context

    def __init__(self, target: MtpHost, assistant: Path | None = None) -> None:
        lc = self._lc = target.lc
        if assistant is not None:
            self._open_assistant(target, Path(assistant))
            return
        name = target.name
        mode = target.mtp_mode
        if target.n_nextn == 0:
            raise UnsupportedModelError(f"{name} has no multi-token-prediction (NextN) layers")
        if mode is None:
            raise UnsupportedModelError(f"{name} declares {target.n_nextn} NextN layer(s), but this llama.cpp has no "
                                        f"MTP graph for its architecture {target.architecture!r}")
        if mode not in ("single head", "chained heads"):
            raise UnsupportedModelError(f"{name} ({target.architecture}) drafts with {mode}; specstack's MTP "
                                        "drafter runs single-head models (qwen35, qwen3next, glm4moe, deepseek ...) "
                                        "and step35's chained heads")
        if not target.mtp_loaded:  # llama.cpp would abort the process on the first MTP call
            raise ModelLoadError(f"{name} was loaded without its NextN layers (ModelConfig.load_mtp is False); "
                                 "load it with load_mtp to draft with MTP")
        self.target = target
        # chained heads: one trained head per draft position (a single-head family with several layers reads one)
        self.chained = mode == "chained heads" and target.n_nextn > 1
        self.n_heads = target.n_nextn if self.chained else 1
        self.n_embd = int(lc.llama_model_n_embd_out(target.model))
        self.n_vocab = target.n_vocab
        self.n_seq = target.n_slots
        params = self._draft_params(target, lc.LLAMA_CONTEXT_TYPE_MTP)
        self._ctx = lc.llama_init_from_model(target.model, params)
        if not self._ctx:
            raise ModelLoadError(f"llama.cpp could not create an MTP context for {name} (n_ctx={params.n_ctx})")
        self._setup(int(params.n_batch))

    def _draft_params(self, target: MtpHost, ctx_type: int | None, n_ctx: int | None = None, n_seq: int | None = None,
                      unified: bool = True):
        """llama.cpp's draft context over the target (``common_speculative_init``): ``ctx_other`` the target's, its
        threads and flash attention; by default every slot's sequence in one unified cache of the target's context
        per slot; ``n_ubatch = n_batch``, a call in one ubatch (an encoder asserts it); ``ctx_type`` the MTP kind,
        or None for a head of its own architecture (llama.cpp's default type)."""
        params = self._lc.llama_context_default_params()
        params.n_seq_max = self.n_seq if n_seq is None else n_seq
        params.n_ctx = target.n_ctx * self.n_seq if n_ctx is None else n_ctx
        params.kv_unified = unified
        params.n_batch = params.n_ubatch = max(1, min(target.n_batch, params.n_ctx))
        params.n_threads = params.n_threads_batch = target.n_threads
        params.flash_attn_type = 1 if target.flash_attn else 0
        params.no_perf = True
        if ctx_type is not None:
            params.ctx_type = ctx_type
        params.ctx_other = target.ctx
        params.n_rs_seq = 0
        return params

    def _open_assistant(self, target: MtpHost, path: Path) -> None:
        """Load the assistant GGUF and its context over the target's KV (llama.cpp's draft-mtp with ``-md``)."""
        lc = self._lc
        if not path.is_file():
            raise ModelLoadError(f"MTP assistant {path} does not exist")
        mparams = lc.llama_model_default_params()
        mparams.load_mtp = True  # llama.cpp loads every model of a draft-mtp run so
        mparams.use_mmap = target.use_mmap
        model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise ModelLoadError(f"llama.cpp could not load the MTP assistant {path} (corrupt or unsupported GGUF?)")
        self._own_model = model
        self.target = target
        self.shared = True
        self.chained = False
        self.n_heads = 1
        self.n_embd = int(lc.llama_model_n_embd_out(model))
        if self.n_embd != int(lc.llama_model_n_embd_out(target.model)):
            self.close()
            raise UnsupportedModelError(f"{path.name} reads hidden rows of width {self.n_embd}, but "
                                        f"{target.name}'s are {int(lc.llama_model_n_embd_out(target.model))} "
                                        "wide: it is the assistant of another model")
        self.n_vocab = target.n_vocab
        self.n_seq = target.n_slots
        # the shared cache takes the target's cells: same size, sequences and streams as the target's context
        params = self._draft_params(target, lc.LLAMA_CONTEXT_TYPE_MTP, int(lc.llama_n_ctx(target.ctx)),
                                    int(lc.llama_n_seq_max(target.ctx)), bool(target.unified))
        self._ctx = lc.llama_init_from_model(model, params)
        if not self._ctx:
            self.close()
            raise ModelLoadError(f"llama.cpp could not create a context for the MTP assistant {path.name} "
                                 f"over {target.name}")
        self._setup(int(params.n_batch))

    def _setup(self, cap: int) -> None:
        """The classic batch that carries a token and a hidden row per row (module docstring)."""
        lc = self._lc
        ext_module().llama_set_embeddings_nextn(self._ctx, True, True)  # h rows of output rows only
        self._mem = lc.llama_get_memory(self._ctx)
        self.cap = cap
        b = self._batch = lc.llama_batch_init(self.cap, self.n_embd, 1)
        # llama_batch_init allocates embd *or* token; the MTP rows carry both: token ids live in numpy here
        # (detached again before llama_batch_free, which would free them).
        self._tok = np.zeros(self.cap, dtype=np.int32)
        b.token = self._tok.ctypes.data_as(ctypes.POINTER(lc.llama_token))
        self._b_embd = np.ctypeslib.as_array(b.embd, shape=(self.cap, self.n_embd))
        self._b_pos = np.ctypeslib.as_array(b.pos, shape=(self.cap,))
        self._b_out = np.ctypeslib.as_array(b.logits, shape=(self.cap,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(self.cap,))[:] = 1
        self._b_seq = [0] * self.cap
        for i in range(self.cap):
            b.seq_id[i][0] = 0
        self.calls = 0
        self.rows = 0

    # -- calls --------------------------------------------------------------------------------------

    def run(self, entries: Sequence[MtpRow], head: int = 0) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """Process every entry's rows (in as many calls as the batch needs: outputs come from the last) and return,
        per entry, (logits [n_vocab], h row [n_embd]) of its last row where it asked for them (copies), else None.
        ``head``: which chained head runs them (0 for single-head models); the offset goes back to 0 after, as
        llama.cpp's driver leaves it."""
        if head == 0:
            return self._run(entries)
        if not 0 < head < self.n_heads:
            raise ValueError(f"head {head} out of range: {self.target.name} has {self.n_heads} chained head(s)")
        ext_module().llama_set_nextn_layer_offset(self._ctx, head)
        try:
            return self._run(entries)
        finally:
            ext_module().llama_set_nextn_layer_offset(self._ctx, 0)

    def catch_up(self, entries: Sequence[MtpRow]) -> None:
        """Rows of the target's pairs, into every head's KV: one ``run`` for a single head; with chained heads,
        each head in turn after the rows' positions are removed (llama.cpp's ``process``)."""
        if not self.chained:
            self.run(entries)
            return
        for head in range(self.n_heads):
            for e in entries:
                self.truncate(e.seq, e.pos)
            self.run(entries, head)

    def _run(self, entries: Sequence[MtpRow]) -> list[tuple[np.ndarray, np.ndarray] | None]:
        queue = [(i, 0) for i, e in enumerate(entries) if len(e.tokens)]
        results: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(entries)
        while queue:
            call, parts, rest, used = [], [], [], 0
            for i, done in queue:
                e = entries[i]
                n = len(e.tokens) - done
                take = min(n, self.cap - used)
                if take <= 0:
                    rest.append((i, done))
                    continue
                call.append((e, done, take))
                parts.append(i)
                used += take
                if take < n:
                    rest.append((i, done + take))
            for i, got in zip(parts, self._call(call)):
                if got is not None:
                    results[i] = got
            queue = rest
        return results

    def _call(self, call: list[tuple[MtpRow, int, int]]) -> list[tuple[np.ndarray, np.ndarray] | None]:
        lc, b = self._lc, self._batch
        m, n_out, where = 0, 0, []
        lasts = [e.output and done + take == len(e.tokens) for e, done, take in call]
        every = self.outputs_all and any(lasts)
        for (e, done, take), last in zip(call, lasts):
            self._tok[m : m + take] = np.asarray(e.tokens[done : done + take], dtype=np.int32)
            self._b_embd[m : m + take] = e.h[done : done + take]
            self._b_pos[m : m + take] = np.arange(e.pos + done, e.pos + done + take, dtype=np.int32)
            self._b_out[m : m + take] = int(every)
            if last:
                self._b_out[m + take - 1] = 1
            for i in range(m, m + take):
                if self._b_seq[i] != e.seq:
                    b.seq_id[i][0] = e.seq
                    self._b_seq[i] = e.seq
            where.append((m + take - 1 if every else n_out) if last else None)
            n_out += int(last)
            m += take
        b.n_tokens = m
        rc = lc.llama_decode(self._ctx, b)
        if rc != 0:
            raise ModelLoadError(f"llama_decode failed (code {rc}) on {m} rows of {self.target.name}'s {self.what}")
        self.calls += 1
        self.rows += m
        if n_out == 0:
            return [None] * len(call)
        n_rows = m if every else n_out
        logits = np.ctypeslib.as_array(lc.llama_get_logits(self._ctx), shape=(n_rows, self.n_vocab))
        h = np.ctypeslib.as_array(ext_module().llama_get_embeddings_nextn(self._ctx), shape=(n_rows, self.n_embd))
        return [None if w is None else (logits[w].copy(), h[w].copy()) for w in where]

    # -- the KV following the target --------------------------------------------------------------

    def truncate(self, seq: int, n_keep: int) -> None:
        """Drop ``seq``'s rows at positions >= ``n_keep``."""
        self._lc.llama_memory_seq_rm(self._mem, seq, n_keep, -1)

    def reset(self, seq: int | None = None) -> None:
        if seq is None:
            self._lc.llama_memory_clear(self._mem, True)
        else:
            self._lc.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def copy(self, src: int, dst: int, n: int) -> None:
        """``dst`` holds ``src``'s first ``n`` positions (shared cells: the cache is unified)."""
        self._lc.llama_memory_seq_rm(self._mem, dst, -1, -1)
        self._lc.llama_memory_seq_cp(self._mem, src, dst, 0, n)

    def save_seq(self, seq: int) -> bytes:
        """A copy of ``seq``'s cache (llama.cpp's per-sequence state), for the host prompt cache."""
        lc = self._lc
        if self.shared:  # the target's KV is the head's: the engine saves it
            return b""
        size = int(lc.llama_state_seq_get_size(self._ctx, seq))
        buf = (ctypes.c_uint8 * size)()
        n = int(lc.llama_state_seq_get_data(self._ctx, buf, size, seq))
        return ctypes.string_at(buf, n)

    def load_seq(self, seq: int, data: bytes) -> bool:
        """Replace ``seq``'s cache with a saved copy; False (and ``seq`` empty) if llama.cpp refuses it."""
        lc = self._lc
        if self.shared:
            return True
        self.reset(seq)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if int(lc.llama_state_seq_set_data(self._ctx, buf, len(data), seq)) == 0:
            self.reset(seq)
            return False
        return True

    def pos_min(self, seq: int) -> int:
        """The first position ``seq`` holds (-1 when empty): 0 where the head has seen the whole context."""
        return int(self._lc.llama_memory_seq_pos_min(self._mem, seq))

    def pos_max(self, seq: int) -> int:
        """The last position ``seq`` holds (-1 when empty)."""
        return int(self._lc.llama_memory_seq_pos_max(self._mem, seq))

    def close(self) -> None:
        lc = self._lc
        if getattr(self, "_batch", None) is not None:
            self._batch.token = ctypes.POINTER(lc.llama_token)()  # ours (numpy), not llama_batch_free's
            lc.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            lc.llama_free(self._ctx)
            self._ctx = None
        if self._own_model:
            lc.llama_model_free(self._own_model)
            self._own_model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
