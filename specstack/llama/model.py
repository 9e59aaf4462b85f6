"""``LlamaModel``: one GGUF model and its context, evaluating batches within exact call shapes.

Loading, the context and batch, and the calls themselves live here; the
sequence and recurrent-state operations (``memory``), tree batches
(``tree``) and the vocabulary (``vocab``) are its other parts.

Why not ``Llama.generate``: its speculation is sample-and-match with no
statistics, and its prompt-lookup path crashed on these models.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses

import warnings
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..errors import ContextOverflowError, KVPoolFullError, ModelLoadError
from .target import DEFAULT_CTX, ModelConfig
from .kv import KVEstimate, check_kv_blocks, check_kv_fits, estimate_kv
from .kernels import resolved_flash_attn
from .backend import (check_gguf_file, init_backend, llama_cpp_module, progress_callback, raise_if_interrupted,
                      recent_log, usable_threads)
from .batching import BatchShapes, Segment, plan_calls, prefill_call
from .heads import DFlashContext, Eagle3Context
from .hidden import HiddenStates
from .memory import SequenceMemory
from .mtp import MtpContext, MtpHost
from .recurrent import Memory, SeqLog
from .tree import TreeBatches
from .vocab import Vocabulary

_MAX_CTX = 2**31 - 1
# ggml.h's enum ggml_type for the KV cache types (``kv.KV_TYPES``); written out because llama_cpp.py lacks
# GGML_TYPE_BF16
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}
MIN_CTX = 16  # below this llama.cpp aborts (a batch must hold every tree branch's output row)  # positions are int32 in llama.cpp


class LlamaModel(SequenceMemory, TreeBatches, Vocabulary, HiddenStates):
    """One GGUF model with a llama.cpp context holding one or more sequences.

    Invariant: sequence s holds exactly ``seq_len[s]`` tokens at positions
    0..seq_len[s]-1.  ``decode`` appends to several sequences in one step,
    ``truncate`` drops a tail.  ``eval``/``n_past`` are the one-sequence view
    (sequence 0) used by draft models, calibration and tools.
    """

    def __init__(self, config: ModelConfig, role: str = "model", *, weights: "LlamaModel | None" = None,
                 positions: int | None = None) -> None:
        """Load ``config.path``; or, with ``weights``, open one more context on that model's loaded weights
        (nothing is read again) holding at most ``positions`` per sequence, for work beside the main context
        (``calibration.background``).  Its config, and so its cache keys, stay those of ``config``."""
        self.config = config
        self.role = role
        self._positions = positions
        self._owns_model = weights is None
        # capped at the CPUs (more only contend and slow down), and said before the weights load, not after
        self.n_threads = usable_threads(config.n_threads)
        if weights is not None:
            self.path, self.meta = weights.path, weights.meta
        else:
            self.path = check_gguf_file(config.path, role)
            from ..modelfile.meta import read_gguf

            self.meta = read_gguf(self.path)
        if config.experts is not None:  # fewer MoE experts: checked here, before the weights load
            override = self.meta.expert_override(config.experts, "--experts" if role == "target" else role)
            self.config = config = dataclasses.replace(config, experts=None,
                                                       kv_overrides=config.kv_overrides + (override,))
        check_kv_blocks(self.meta, config.type_k, config.type_v, self.path.name)  # before llama.cpp could abort on it
        if self.meta.tensor_count == 0:
            raise ModelLoadError(f"{role} {self.path} is a vocabulary-only GGUF (no weights): `specstack check` can "
                                 "compare its tokenizer, but it cannot run; pass a model with weights")
        init_backend()
        self._lc = lc = llama_cpp_module()
        self._model = self._load_model() if weights is None else weights._model
        self._vocab = lc.llama_model_get_vocab(self._model)
        # NextN (MTP) layers: llama.cpp reports them even where they were not loaded (``mtp_loaded``), and an MTP
        # context on such a load aborts the process (``llama.mtp``).
        self.n_nextn = int(lc.llama_model_n_layer_nextn(self._model))
        self.mtp_loaded = self._owns_model and self._load_mtp() and self.n_nextn > 0 or \
            (weights is not None and weights.mtp_loaded)
        self._mtp_contexts: list[MtpContext] = []  # MTP heads, EAGLE-3 and DFlash heads (``llama.heads``)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(lc.llama_model_n_ctx_train(self._model))
        self.n_swa = int(lc.llama_model_n_swa(self._model))  # sliding-window size; 0 where there is none
        self.memory: Memory = ("hybrid" if lc.llama_model_is_hybrid(self._model) else
                               "recurrent" if lc.llama_model_is_recurrent(self._model) else "attention")
        self.is_recurrent = self.memory != "attention"
        self.n_slots = max(1, config.n_slots)
        self._pooled = self._wants_pool(config)
        self.unified = True if self._pooled else config.unified if config.unified is not None else self.n_slots == 1
        # Tree branches need one recurrent state each; recurrent targets verify chains.
        self.n_seq_max = max(self.n_slots, config.n_seq_max if self.unified and not self.is_recurrent else 1)
        self.flash_attn = resolved_flash_attn(config.flash_attn, self._file_type())
        self._ctx = self._new_context()
        self._init_rewind()
        # Positions per sequence: a unified cache is shared (sized slots x n_ctx, or one pool of n_ctx: any
        # sequence may fill it, as llama-server's n_ctx_slot with kv_unified), streams are per sequence.
        cells = int(lc.llama_n_ctx(self._ctx))
        self.n_ctx = cells if self._pooled else cells // self.n_slots if self.unified else int(lc.llama_n_ctx_seq(self._ctx))
        # The cells all sequences share (``ModelConfig.kv_pool``); None: each sequence has its own n_ctx.
        self.pool: int | None = cells if self._pooled else None
        self._mem = lc.llama_get_memory(self._ctx)
        # llama.cpp rounds a small n_ctx up (to 256) but keeps the n_batch it was given: a call is capped by both.
        n_batch = min(int(lc.llama_n_batch(self._ctx)), int(lc.llama_n_ubatch(self._ctx)))
        self._batch_cap = self.batch_cap = max(1, min(config.n_batch, self.n_ctx, n_batch))
        self.seq_len = [0] * self.n_seq_max
        self._logs = [SeqLog() for _ in range(self.n_seq_max)]
        # Writes per sequence (decode, truncate, reset): a cache that remembers what a sequence held
        # checks this to know nobody else (another engine, a calibration) has changed it since.
        self.writes = [0] * self.n_seq_max
        self._batch = lc.llama_batch_init(self._batch_cap, 0, self.n_seq_max + (1 if self.is_recurrent else 0))
        self._init_batch_views()
        self.set_shapes(BatchShapes(min_rows=max(1, config.min_batch), max_rows=self._batch_cap))
        # Entered around every llama_decode: a context that works beside another (``sibling``) takes turns on
        # the cores through a ``calibration.background.Gate``; alone, nothing to wait for.
        self.gate: contextlib.AbstractContextManager = contextlib.nullcontext()
        self.tree_relayouts = 0  # tree paths that had to be re-decoded to keep exact KV layout
        self._piece_cache: dict[int, bytes] = {}
        self.bos_id = int(lc.llama_vocab_bos(self._vocab))
        self.eos_id = int(lc.llama_vocab_eos(self._vocab))
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self._vocab))

    def set_shapes(self, shapes: BatchShapes) -> None:
        """Adopt measured (or assumed) exact shapes; positions for padding are reserved."""
        cap = min(shapes.max_rows, self._batch_cap)
        # Uneven calls need one unified cache, and exact shapes were measured on even ones.
        even = not (self.unified and self.n_slots > 1 and not shapes.exact)
        self.shapes = dataclasses.replace(shapes, max_rows=max(cap, shapes.min_rows), even_rows=even)
        self.min_batch = self.shapes.min_rows
        # Positions usable by real tokens: padding needs min_rows - 1 spare slots.
        self.capacity = self.n_ctx - (self.min_batch - 1)

    def pool_used(self) -> int:
        """Cells the sequences hold together (a unified cache: one cell per position per sequence; nothing here
        shares cells between slots)."""
        return sum(self.seq_len)

    def _file_type(self) -> int | None:
        """``general.file_type`` (llama_ftype: 15 is Q4_K_M), None where the file does not say."""
        buf = ctypes.create_string_buffer(32)
        n = self._lc.llama_model_meta_val_str(self._model, b"general.file_type", buf, 32)
        try:
            return int(buf.value) if n > 0 else None
        except ValueError:
            return None

    def _wants_pool(self, config: ModelConfig) -> bool:
        """Whether the slots share one pool of n_ctx cells (``ModelConfig.kv_pool``): only an attention-only
        model of several slots, since a recurrent state is one per slot (warned: each slot then has its own)."""
        if not config.kv_pool or self.n_slots < 2:
            return False
        if self.is_recurrent:
            warnings.warn(f"{self.role} {self.path.name}: a {self.memory} model keeps one state per slot, so its "
                          f"{self.n_slots} slots cannot share one KV pool (-kvu): each gets its own context",
                          stacklevel=3)
            return False
        return True

    @property
    def n_past(self) -> int:
        return self.seq_len[0]

    @n_past.setter
    def n_past(self, value: int) -> None:
        self.seq_len[0] = value

    # -- loading -----------------------------------------------------------

    def _load_mtp(self) -> bool:
        """Whether to load the NextN layers (``ModelConfig.load_mtp``; None: where this llama.cpp can run them)."""
        wanted = self.config.load_mtp
        return bool(self.meta.mtp_mode is not None if wanted is None else wanted and self.meta.nextn_layers > 0)

    def open_mtp(self, assistant: Path | None = None) -> MtpContext:
        """A context on this model's NextN head (``llama.mtp.MtpContext``), closed with this model; ``assistant``:
        the separate head GGUF of a family that ships one (gemma4), run over this model's KV."""
        ctx = MtpContext(self._host(), assistant)
        self._mtp_contexts.append(ctx)
        return ctx

    def open_eagle3(self, head: Path) -> Eagle3Context:
        """An EAGLE-3 head GGUF on a context beside this model's (``llama.heads.Eagle3Context``), closed with it.
        The caller keeps the head's layer inputs (``want_hidden(context.target_layers)``)."""
        ctx = Eagle3Context(self._host(), head)
        self._mtp_contexts.append(ctx)
        return ctx

    def open_dflash(self, head: Path) -> DFlashContext:
        """A DFlash head GGUF on a context beside this model's (``llama.heads.DFlashContext``), closed with it.
        The caller keeps the head's layer inputs (``want_hidden(context.target_layers)``)."""
        ctx = DFlashContext(self._host(), head)
        self._mtp_contexts.append(ctx)
        return ctx

    def _host(self) -> MtpHost:
        """What a head's context reads of this model (``llama.mtp.MtpHost``)."""
        return MtpHost(self._lc, self._model, self._ctx, self.path.name, self.meta.architecture, self.meta.mtp_mode,
                       self.n_nextn, self.mtp_loaded, self.n_vocab, self.n_slots, self.n_ctx, self.config.n_batch,
                       self.n_threads, self.flash_attn, self.unified, self.config.use_mmap)

    def _load_model(self):
        lc = self._lc
        params = lc.llama_model_default_params()
        params.load_mtp = self._load_mtp()
        params.use_extra_bufts = self.config.repack
        params.load_mode = self.config.load_mode()
        for name, value in self.config.model_params:  # --lazy-mode, --check-tensors
            setattr(params, name, value)
        self._kv_override_array = None
        if self.config.kv_overrides:
            params.kv_overrides = self._make_overrides()
        params.progress_callback = progress_callback()  # a Ctrl-C during the load aborts it
        recent_log.clear()
        model = lc.llama_model_load_from_file(str(self.path).encode(), params)
        if model:
            self._interrupted(lambda: lc.llama_model_free(model))
        else:
            raise_if_interrupted()  # the progress callback stopped the load: an interrupt, not a bad file
            tail = " | ".join(line.strip() for line in recent_log[-4:] if line.strip())
            raise ModelLoadError(
                f"llama.cpp could not load {self.role} {self.path} (corrupt or unsupported GGUF?)"
                + (f": {tail}" if tail else "")
            )
        return model

    def _make_overrides(self):
        """kv_overrides, each typed by its value's Python type: ``{arch}.expert_used_count`` (lossy MoE reduction),
        --override-kv's int, float, bool and str."""
        lc = self._lc
        items = list(self.config.kv_overrides)
        arr = (lc.llama_model_kv_override * (len(items) + 1))()
        for i, (key, value) in enumerate(items):
            arr[i].key = key.encode()
            if isinstance(value, bool):
                arr[i].tag, arr[i].value.val_bool = lc.LLAMA_KV_OVERRIDE_TYPE_BOOL, value
            elif isinstance(value, float):
                arr[i].tag, arr[i].value.val_f64 = lc.LLAMA_KV_OVERRIDE_TYPE_FLOAT, value
            elif isinstance(value, str):
                arr[i].tag, arr[i].value.val_str = lc.LLAMA_KV_OVERRIDE_TYPE_STR, value.encode()
            else:
                arr[i].tag, arr[i].value.val_i64 = lc.LLAMA_KV_OVERRIDE_TYPE_INT, int(value)
        arr[len(items)].key = b"\0"
        self._kv_override_array = arr  # must outlive the load call
        return arr

    def _new_context(self):
        lc = self._lc
        params = lc.llama_context_default_params()
        per_seq = self._ctx_per_seq()
        if per_seq < MIN_CTX:
            self._free_model()
            raise ModelLoadError(f"--ctx-size {per_seq} is too small: a sequence needs at least {MIN_CTX} positions "
                                 "(prompt, new tokens and the rows a draft or a padded step adds); use -c 4096, the default")
        scratch = 1 if self.is_recurrent else 0
        total = per_seq if self._pooled else per_seq * (self.n_slots + (scratch if not self.unified else 0))
        if total > _MAX_CTX:  # llama.cpp's n_ctx is 32-bit: a larger one wraps and aborts inside llama.cpp
            self._free_model()
            raise ModelLoadError(f"context of {total} positions ({per_seq} per sequence x {total // per_seq}) is more "
                                 f"than llama.cpp can address ({_MAX_CTX}); use a smaller --ctx-size")
        if per_seq > self.n_ctx_train:
            given = self.config.ctx_origin or f"--ctx-size {per_seq}"
            warnings.warn(f"{self.role} {self.path.name}: {given} is more than the {self.n_ctx_train} "
                          "positions it was trained on; output past that may degrade", stacklevel=2)
        self.kv = estimate_kv(self.meta, per_seq, total, self.config.type_k, self.config.type_v,
                              shared_by=self.n_slots if self._pooled else 1)
        check_kv_fits(self.kv, self.role, self.path.name, per_seq, self._free_model)
        params.n_ctx = total
        # Not capped by n_ctx here: llama.cpp rounds a small n_ctx up (to 256) and caps n_batch by that; a batch
        # smaller than n_seq_max (-c 3 with 8 tree branches) would abort inside llama.cpp.
        params.n_batch = params.n_ubatch = max(1, self.config.n_batch)
        params.n_threads = params.n_threads_batch = self.n_threads
        if self.config.n_threads_batch:  # -tb: multi-row calls on threads of their own count
            params.n_threads_batch = usable_threads(self.config.n_threads_batch)
        for name, value in self.config.context_params:  # RoPE scaling and YaRN (--rope-scaling, --yarn-*)
            setattr(params, name, value)
        params.n_seq_max = self.n_seq_max + scratch
        if self.is_recurrent and self.config.rollback != "checkpoint":
            params.n_rs_seq = self.config.rollback_depth
        params.kv_unified = self.unified  # tree branches share the cached prefix
        params.flash_attn_type = 1 if self.flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        params.type_k, params.type_v = self._ggml_type(self.config.type_k), self._ggml_type(self.config.type_v)
        params.no_perf = True
        ctx = lc.llama_init_from_model(self._model, params)

        def release() -> None:
            if ctx:
                lc.llama_free(ctx)
            self._free_model()

        self._interrupted(release)
        if not ctx:
            self._free_model()
            raise ModelLoadError(f"llama.cpp could not create a context for {self.path} (n_ctx={params.n_ctx}); try a smaller --ctx-size")
        return ctx

    @staticmethod
    def _ggml_type(name: str) -> int:
        """ggml's type id of a KV cache type name (``kv.KV_TYPES``), as llama_context_params.type_k/type_v take it."""
        return GGML_TYPES[name]

    @staticmethod
    def _interrupted(release: Callable[[], object]) -> None:
        """After a llama.cpp call that logs (loading, a context): a Ctrl-C its callbacks held back is raised here,
        once ``release`` has freed what the call made (nobody else holds it yet)."""
        try:
            raise_if_interrupted()
        except KeyboardInterrupt:
            release()
            raise

    def _ctx_per_seq(self) -> int:
        """Positions per sequence: ``-c`` if given (0: the trained context), else llama.cpp's default 4096,
        or the trained context where that is shorter."""
        trained = self.n_ctx_train if self.n_ctx_train > 0 else DEFAULT_CTX
        per_seq = min(DEFAULT_CTX, trained) if self.config.n_ctx is None else (self.config.n_ctx or trained)
        return per_seq if self._positions is None else min(per_seq, self._positions)

    def sibling(self, positions: int) -> "LlamaModel":
        """Another context on these weights, ``positions`` per sequence at most, configured as this one."""
        return LlamaModel(self.config, role=f"{self.role} (second context)", weights=self, positions=positions)

    def reopen(self, **changes: object) -> "LlamaModel":
        """This model with ``changes`` to its context's ``ModelConfig`` fields (the KV layout, flash attention):
        a new context on the same weights (about 40 ms for Gemma 3 270M; nothing is read again), which it takes
        over; this one's context is freed first, so two KV caches are never held.  Only before any sequence
        holds anything."""
        config = dataclasses.replace(self.config, **changes)
        self._close_context()
        reopened = LlamaModel(config, role=self.role, weights=self)
        reopened._owns_model, self._owns_model, self._model = self._owns_model, False, None
        return reopened

    def _free_model(self) -> None:
        if self._owns_model:  # a sibling context never frees the weights it borrowed
            self._lc.llama_model_free(self._model)
        self._model = None  # freed here: close() must not free it again

    def _init_batch_views(self) -> None:
        """numpy views over the batch arrays: filling a batch is then vectorised."""
        b, n = self._batch, self._batch_cap
        self._b_token = np.ctypeslib.as_array(b.token, shape=(n,))
        self._b_pos = np.ctypeslib.as_array(b.pos, shape=(n,))
        self._b_logits = np.ctypeslib.as_array(b.logits, shape=(n,))
        self._b_nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(n,))
        self._b_nseq[:] = 1
        self._b_seq0 = [0] * n  # sequence id currently written in each row's first slot
        for i in range(n):
            b.seq_id[i][0] = 0

    def close(self) -> None:
        self._close_context()
        if getattr(self, "_model", None):
            self._free_model()

    def _close_context(self) -> None:
        """Free the context and what uses it (MTP heads, the batch); the weights stay."""
        lc = self._lc
        for mtp in getattr(self, "_mtp_contexts", ()):  # they use this model's weights and context
            mtp.close()
        if getattr(self, "_batch", None) is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            lc.llama_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:  # best effort; explicit close() is preferred
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> "LlamaModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
    # -- evaluation --------------------------------------------------------

    def eval(self, tokens: Sequence[int], logits_from: int | None = None, seq: int = 0) -> np.ndarray:
        """Append ``tokens`` to ``seq`` and return logits for rows logits_from..end.

        Returns a [n_rows, n_vocab] float32 array; it may be a *view* of
        llama.cpp's buffer, valid until the next call (copy it to keep it).
        ``logits_from=None`` means only the last row; ``len(tokens)`` means
        none (a prefill: chunked at multiples of ``prefill_chunk``).
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("eval needs at least one token")
        wanted = n - 1 if logits_from is None else logits_from
        if wanted >= n:
            self.prefill(tokens, seq)
            return np.empty((0, self.n_vocab), dtype=np.float32)
        rows = self.decode([Segment(seq, tokens, wanted)])[0]
        assert rows is not None
        return rows

    def prefill(self, tokens: Sequence[int], seq: int = 0) -> None:
        """Append prompt tokens without logits, in calls whose edges sit at multiples of ``prefill_chunk``.

        Fixed edges make a later prefill that resumes from a chunk edge of a
        reused prefix compute exactly what a cold prefill computes.
        """
        chunk = prefill_call(self.config.prefill_chunk, self._batch_cap)
        start, n = 0, len(tokens)
        while start < n:
            edge = (self.seq_len[seq] // chunk + 1) * chunk
            m = min(n - start, edge - self.seq_len[seq])
            self._check_room(seq, max(m, self.min_batch))
            part = list(tokens[start : start + m])
            self._call([(seq, part, max(0, self.min_batch - m), m)])
            start += m

    def decode(self, segments: Sequence[Segment]) -> list[np.ndarray | None]:
        """Append each segment's tokens to its sequence in as few calls as exactness allows.

        Returns, per segment, the logits of its rows ``logits_from``.. (or
        None when it wants none): a view into llama.cpp's buffer when one
        call did it all (valid until the next call), else a copy.
        """
        for s in segments:
            self._check_room(s.seq, len(s.tokens))
        self._check_pool(sum(len(s.tokens) for s in segments))
        if len(segments) > 1 and self.is_recurrent:
            # One call per sequence: a recurrent ubatch needs equal rows per sequence, and
            # padding rows on the sequence itself would advance its state.
            return [None if (r := self.decode([seg])[0]) is None else r.copy() for seg in segments]
        if len(segments) == 1 and len(segments[0].tokens) <= self.shapes.max_rows:  # the common case, no planning
            s = segments[0]
            n = len(s.tokens)
            pad = max(0, min(self.shapes.rows_for(n) - n, self.n_ctx - self.seq_len[s.seq] - n))
            return self._call([(s.seq, list(s.tokens), pad, s.logits_from)])
        rows = [len(s.tokens) for s in segments]
        seqs = [s.seq for s in segments]
        room = [self.n_ctx - self.seq_len[s.seq] - len(s.tokens) for s in segments]
        calls = plan_calls(rows, seqs, self.shapes.min_rows, self.shapes.max_rows, room, self.shapes.even_rows,
                           self.shapes.pad_to)
        out: list[list[np.ndarray]] = [[] for _ in segments]
        for call in calls:
            entries = []
            for p in call:
                seg = segments[p.segment]
                local_from = min(max(seg.logits_from - p.start, 0), p.count)
                entries.append((seqs[p.segment], list(seg.tokens[p.start : p.start + p.count]), p.pad, local_from))
            for p, part in zip(call, self._call(entries)):
                if part is not None:
                    out[p.segment].append(part if len(calls) == 1 else part.copy())
        return [np.concatenate(o) if len(o) > 1 else (o[0] if o else None) for o in out]

    def _check_room(self, seq: int, n: int) -> None:
        if self.seq_len[seq] + n > self.n_ctx:
            raise ContextOverflowError(
                f"{self.role} context is full: {self.seq_len[seq]} + {n} tokens > n_ctx {self.n_ctx}; "
                "use a shorter prompt, fewer max tokens or a larger --ctx-size"
            )
        self._check_pool(n)

    def _check_pool(self, n: int) -> None:
        """Refuse a call of ``n`` more cells where the shared pool has fewer free (llama.cpp would fail it)."""
        if self.pool is not None and self.pool_used() + n > self.pool:
            raise KVPoolFullError(
                f"{self.role}'s shared KV pool is full: its sequences hold {self.pool_used()} of {self.pool} cells, "
                f"{n} more do not fit; raise --ctx-size or serve fewer slots at once"
            )

    def _call(self, entries: Sequence[tuple[int, list[int], int, int]],
              pad_logits: bool | None = None) -> list[np.ndarray | None]:
        """One ``llama_decode``: per entry (seq, tokens, pad, logits_from) the tokens then ``pad`` copies of the last.

        Pads are dropped from the KV cache right after; causal attention means
        they cannot change the real rows.  A recurrent model's pads would advance
        its state: they stay as phantoms rolled back with the next cut (rollback)
        or go to the scratch sequence (checkpoint); see ``_init_rewind``.  Output rows: on an exact target
        every row of the call (pads too, unless ``pad_logits``, by default the
        measured ``shapes.pad_logits``, is off) when any entry wants logits, else
        none; otherwise just each entry's rows from ``logits_from``.  Returns
        per entry the logits of its rows from ``logits_from`` (None if none).
        """
        lc, b = self._lc, self._batch
        if self.is_recurrent:
            for seq, *_ in entries:
                self._settle(seq)
        exact = self.config.exact
        all_out = exact and any(f < len(t) for _, t, _, f in entries)
        pad_out = self.shapes.pad_logits if pad_logits is None else pad_logits
        m = out_row = 0
        where: list[int | None] = []  # output row of each entry's first wanted row
        scratch = self._scratch
        for seq, toks, pad, first in entries:
            n = len(toks) + pad
            n_out = n if pad_out else len(toks)
            wanted = first < len(toks)
            where.append((out_row + first if all_out else out_row) if wanted else None)
            out_row += n_out if all_out else (len(toks) - first if wanted and not exact else 0)
            start = self.seq_len[seq]
            self._b_token[m : m + len(toks)] = toks
            self._b_token[m + len(toks) : m + n] = toks[-1]
            self._b_pos[m : m + n] = np.arange(start, start + n, dtype=np.int32)
            if scratch >= 0 and pad:  # pads of a recurrent model: the scratch sequence, from position 0
                self._b_pos[m + len(toks) : m + n] = np.arange(pad, dtype=np.int32)
            if all_out:
                self._b_logits[m : m + n_out] = 1
                self._b_logits[m + n_out : m + n] = 0
            else:
                self._b_logits[m : m + n] = 0
                if not exact and first < len(toks):
                    self._b_logits[m + first : m + len(toks)] = 1
            for i in range(m, m + n):
                row_seq = seq if i < m + len(toks) or scratch < 0 else scratch
                if self._b_seq0[i] != row_seq:
                    b.seq_id[i][0] = row_seq
                    self._b_seq0[i] = row_seq
            m += n
        if m > self._batch_cap:
            raise ValueError(f"decode call of {m} rows exceeds the batch capacity {self._batch_cap}")
        b.n_tokens = m
        with self.gate:
            rc = lc.llama_decode(self._ctx, b)
        if rc == 1 and self.pool is not None:  # no free cells: llama.cpp placed nothing (it prepares every ubatch first)
            raise KVPoolFullError(f"llama.cpp found no free cells for {m} tokens in {self.path.name}'s shared KV pool "
                                  f"({self.pool_used()} of {self.pool} held)")
        if rc != 0:
            raise ContextOverflowError(
                f"llama_decode failed (code {rc}) on {m} tokens of {self.path.name}; "
                "the KV cache may be full: use a larger --ctx-size or a shorter prompt"
            )
        if self._staged is not None:  # hidden rows for drafters that condition on the target (``hidden``)
            self._stage_hidden([(seq, self.seq_len[seq], len(toks), len(toks) + pad) for seq, toks, pad, _ in entries], m)
        for seq, toks, pad, _ in entries:
            self.seq_len[seq] += len(toks)
            self.writes[seq] += 1
            if self.is_recurrent:
                self._logs[seq].appended(toks, pad if scratch < 0 else 0)
                if pad and scratch >= 0:
                    lc.llama_memory_seq_rm(self._mem, scratch, -1, -1)
            elif pad:
                lc.llama_memory_seq_rm(self._mem, seq, self.seq_len[seq], -1)
        raise_if_interrupted()  # held back by the log callback during the call; the bookkeeping above is done
        if out_row == 0:
            return [None] * len(entries)
        logits = np.ctypeslib.as_array(lc.llama_get_logits(self._ctx), shape=(out_row, self.n_vocab))
        return [None if w is None else logits[w : w + len(t) - f] for w, (_, t, _, f) in zip(where, entries)]

    def raw_call(self, tokens: Sequence[int], outputs: bool = True, seq: int = 0, pad: int = 0,
                 pad_logits: bool | None = None) -> np.ndarray:
        """One unsplit call, padded by ``pad`` rows only (shape measurement and cost curves need exact shapes)."""
        self._check_room(seq, len(tokens) + pad)
        rows = self._call([(seq, list(tokens), pad, 0 if outputs else len(tokens))], pad_logits)[0]
        return rows if rows is not None else np.empty((0, self.n_vocab), dtype=np.float32)
