"""llama.cpp models through llama-cpp-python's low-level API (the only llama_cpp import).

A ``LlamaModel`` owns one model and one context with a single sequence.  It
evaluates a batch of tokens at consecutive positions and returns logits for
the rows asked for, and truncates the KV cache after a position (rollback
after a rejected draft).  The same class serves as target and as draft model.

Why not ``Llama.generate``: its speculation is sample-and-match with no
statistics, and its prompt-lookup path crashed on these models.
"""

from __future__ import annotations

import ctypes
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

# Batch shapes, the call plan, ModelConfig and the Target protocols live in llama_cpp-free
# modules; they are re-exported here so ``from specstack.target import ...`` keeps working.
from .batching import INEXACT, BatchShapes, Piece, Segment, plan_calls  # noqa: F401 - re-exported
from ..errors import ContextOverflowError, ModelLoadError, UnsupportedModelError
from .recurrent import RollbackError, Memory, RewindStats, SeqLog, Strategy, needs_checkpoint, plan_cut
from .api import EngineTarget, ModelConfig, Target  # noqa: F401 - re-exported

_GGUF_MAGIC = b"GGUF"
_PARTIAL = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: just the recurrent part of a sequence's state
_backend_lock = threading.Lock()
_backend_ready = False
_recent_log: list[str] = []  # last llama.cpp log lines, quoted in load errors
_log_state = {"verbose": False}
_log_callback = None  # keep the ctypes callback alive for the process lifetime


def _llama():
    """Import llama_cpp lazily, so commands that only read metadata stay fast."""
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - install problem
        raise ModelLoadError(
            f"llama-cpp-python is not importable ({exc}); install it with `pip install llama-cpp-python==0.3.36`"
        ) from None
    return llama_cpp


def set_verbose(verbose: bool) -> None:
    """Show llama.cpp's own log on stderr (off by default: it is very chatty)."""
    _log_state["verbose"] = verbose


def _init_backend() -> None:
    """Initialise llama.cpp once and route its log through a quiet callback."""
    global _backend_ready, _log_callback
    with _backend_lock:
        if _backend_ready:
            return
        lc = _llama()

        def on_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            line = text.decode("utf-8", errors="replace") if text else ""
            _recent_log.append(line)
            del _recent_log[:-40]
            if _log_state["verbose"]:
                import sys

                sys.stderr.write(line)

        _log_callback = lc.llama_log_callback(on_log)
        lc.llama_log_set(_log_callback, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _backend_ready = True


def check_gguf_file(path: str | Path, role: str = "model") -> Path:
    """Fail early, clearly, on a missing or non-GGUF file (llama.cpp would only say 'failed')."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"{role} file not found: {p}; pass an existing .gguf file (see `specstack models scan DIR`)")
    if p.is_dir():
        raise ModelLoadError(f"{role} path is a directory, not a GGUF file: {p}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(
            f"{role} file is not GGUF (starts with {magic!r}, expected b'GGUF'): {p}; "
            "convert it with llama.cpp's convert_hf_to_gguf.py or pick a .gguf file"
        )
    return p


def default_threads() -> int:
    """Physical cores: llama.cpp decoding gains nothing from SMT siblings."""
    try:
        from ..machine.sysinfo import physical_cores

        return max(1, physical_cores())
    except Exception:  # sysinfo missing or unreadable /proc: fall back
        import os

        return max(1, os.cpu_count() or 1)


class LlamaModel:
    """One GGUF model with a llama.cpp context holding one or more sequences.

    Invariant: sequence s holds exactly ``seq_len[s]`` tokens at positions
    0..seq_len[s]-1.  ``decode`` appends to several sequences in one step,
    ``truncate`` drops a tail.  ``eval``/``n_past`` are the one-sequence view
    (sequence 0) used by draft models, calibration and tools.
    """

    def __init__(self, config: ModelConfig, role: str = "model") -> None:
        self.config = config
        self.role = role
        self.path = check_gguf_file(config.path, role)
        from ..machine.gguf_meta import read_gguf

        if read_gguf(self.path).tensor_count == 0:
            raise ModelLoadError(f"{role} {self.path} is a vocabulary-only GGUF (no weights): `specstack check` can "
                                 "compare its tokenizer, but it cannot run; pass a model with weights")
        _init_backend()
        self._lc = lc = _llama()
        self._model = self._load_model()
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(lc.llama_model_n_ctx_train(self._model))
        self.memory: Memory = ("hybrid" if lc.llama_model_is_hybrid(self._model) else
                               "recurrent" if lc.llama_model_is_recurrent(self._model) else "attention")
        self.is_recurrent = self.memory != "attention"
        self.n_threads = config.n_threads or default_threads()
        self.n_slots = max(1, config.n_slots)
        self.unified = config.unified if config.unified is not None else self.n_slots == 1
        # Tree branches need one recurrent state each; recurrent targets verify chains.
        self.n_seq_max = max(self.n_slots, config.n_seq_max if self.unified and not self.is_recurrent else 1)
        self.flash_attn = config.flash_attn
        self._ctx = self._new_context()
        self._init_rewind()
        # Positions per sequence: a unified cache is shared (sized slots x n_ctx), streams are per sequence.
        self.n_ctx = int(lc.llama_n_ctx(self._ctx)) // self.n_slots if self.unified else int(lc.llama_n_ctx_seq(self._ctx))
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch_cap = self.batch_cap = max(1, min(config.n_batch, self.n_ctx))
        self.seq_len = [0] * self.n_seq_max
        self._logs = [SeqLog() for _ in range(self.n_seq_max)]
        # Writes per sequence (decode, truncate, reset): a cache that remembers what a sequence held
        # checks this to know nobody else (another engine, a calibration) has changed it since.
        self.writes = [0] * self.n_seq_max
        self._batch = lc.llama_batch_init(self._batch_cap, 0, self.n_seq_max + (1 if self.is_recurrent else 0))
        self._init_batch_views()
        self.set_shapes(BatchShapes(min_rows=max(1, config.min_batch), max_rows=self._batch_cap))
        self.tree_relayouts = 0  # tree paths that had to be re-decoded to keep exact KV layout
        self._piece_cache: dict[int, bytes] = {}
        self.bos_id = int(lc.llama_vocab_bos(self._vocab))
        self.eos_id = int(lc.llama_vocab_eos(self._vocab))
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self._vocab))

    def set_shapes(self, shapes: BatchShapes) -> None:
        """Adopt measured (or assumed) exact shapes; positions for padding are reserved."""
        cap = min(shapes.max_rows, self._batch_cap)
        self.shapes = BatchShapes(shapes.min_rows, max(cap, shapes.min_rows), shapes.prefill_exact, shapes.settled, shapes.exact)
        self.min_batch = self.shapes.min_rows
        # Positions usable by real tokens: padding needs min_rows - 1 spare slots.
        self.capacity = self.n_ctx - (self.min_batch - 1)

    @property
    def n_past(self) -> int:
        return self.seq_len[0]

    @n_past.setter
    def n_past(self, value: int) -> None:
        self.seq_len[0] = value

    # -- loading -----------------------------------------------------------

    def _load_model(self):
        lc = self._lc
        params = lc.llama_model_default_params()
        params.use_extra_bufts = self.config.repack
        self._kv_override_array = None
        if self.config.kv_overrides:
            params.kv_overrides = self._make_overrides()
        _recent_log.clear()
        model = lc.llama_model_load_from_file(str(self.path).encode(), params)
        if not model:
            tail = " | ".join(line.strip() for line in _recent_log[-4:] if line.strip())
            raise ModelLoadError(
                f"llama.cpp could not load {self.role} {self.path} (corrupt or unsupported GGUF?)"
                + (f": {tail}" if tail else "")
            )
        return model

    def _make_overrides(self):
        """kv_overrides for integer keys, e.g. ``{arch}.expert_used_count`` (lossy MoE reduction)."""
        lc = self._lc
        items = list(self.config.kv_overrides)
        arr = (lc.llama_model_kv_override * (len(items) + 1))()
        for i, (key, value) in enumerate(items):
            arr[i].key = key.encode()
            arr[i].tag = lc.LLAMA_KV_OVERRIDE_TYPE_INT
            arr[i].value.val_i64 = int(value)
        arr[len(items)].key = b"\0"
        self._kv_override_array = arr  # must outlive the load call
        return arr

    def _new_context(self):
        lc = self._lc
        params = lc.llama_context_default_params()
        per_seq = self.config.n_ctx or self.n_ctx_train
        scratch = 1 if self.is_recurrent else 0
        params.n_ctx = per_seq * (self.n_slots + (scratch if not self.unified else 0))
        params.n_batch = params.n_ubatch = max(1, min(self.config.n_batch, params.n_ctx))
        params.n_threads = params.n_threads_batch = self.n_threads
        params.n_seq_max = self.n_seq_max + scratch
        if self.is_recurrent and self.config.rollback != "checkpoint":
            params.n_rs_seq = self.config.rollback_depth
        params.kv_unified = self.unified  # tree branches share the cached prefix
        params.flash_attn_type = 1 if self.flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        params.no_perf = True
        ctx = lc.llama_init_from_model(self._model, params)
        if not ctx:
            lc.llama_model_free(self._model)
            self._model = None  # freed here: close() must not free it again
            raise ModelLoadError(f"llama.cpp could not create a context for {self.path} (n_ctx={params.n_ctx}); try a smaller --ctx-size")
        return ctx

    def _init_rewind(self) -> None:
        """Pick how this model's state is cut back (``recurrent``): llama.cpp reports whether rollback took."""
        self.rewind = RewindStats()
        self.rollback_depth = int(self._lc.llama_n_rs_seq(self._ctx)) if self.is_recurrent else 0
        if not self.is_recurrent:
            self.strategy: Strategy = "truncate"
        elif self.rollback_depth > 0:
            self.strategy = "rollback"
        elif self.config.rollback == "rollback":
            arch = self._arch()
            self.close()
            raise UnsupportedModelError(
                f"{self.path.name} ({arch}) cannot roll back its recurrent state in this llama.cpp "
                "(llm_arch_supports_rs_rollback is false for it); use --rollback checkpoint (or auto)")
        else:
            self.strategy = "checkpoint"
        # Longest draft one verification may carry: a rollback reaches n_rs_seq - 1 tokens back.
        self.max_draft = self.rollback_depth - 1 if self.strategy == "rollback" else 1 << 30
        # Padding rows: on the sequence itself they would advance its state.  With rollback they stay
        # there as "phantoms" and are rolled back with the next cut, so a padded call computes what a
        # same-sequence call of that many rows computes (LFM2's conv layers batch rows per sequence:
        # rows of two sequences are two one-row products, which differ).  Without rollback they go
        # to a scratch sequence, cleared after the call.
        self._scratch = self.n_seq_max if self.strategy == "checkpoint" else -1

    def _arch(self) -> str:
        buf = ctypes.create_string_buffer(64)
        n = self._lc.llama_model_meta_val_str(self._model, b"general.architecture", buf, 64)
        return buf.value.decode(errors="replace") if n > 0 else "unknown architecture"

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
        lc = self._lc
        if getattr(self, "_batch", None) is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            lc.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lc.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:  # best effort; explicit close() is preferred
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> "LlamaModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sequences ---------------------------------------------------------

    def reset(self, seq: int | None = None) -> None:
        """Forget the whole KV cache, or one sequence's part of it."""
        if seq is None:
            self._lc.llama_memory_clear(self._mem, True)
            self.seq_len = [0] * self.n_seq_max
            self.writes = [w + 1 for w in self.writes]
            for log in self._logs:
                log.forget()
        else:
            self._lc.llama_memory_seq_rm(self._mem, seq, -1, -1)
            self.seq_len[seq] = 0
            self.writes[seq] += 1
            self._logs[seq].forget()

    def truncate(self, n_keep: int, seq: int = 0) -> None:
        """Drop ``seq``'s tokens from position ``n_keep`` on (rollback after a rejection).

        Attention KV is cut by position.  A recurrent state is rolled back or
        restored from a checkpoint (``recurrent.plan_cut``); where neither can
        reach ``n_keep``, ``RollbackError`` is raised and nothing changes.
        """
        if n_keep >= self.seq_len[seq]:
            return
        if self.is_recurrent:
            self._cut_recurrent(n_keep, seq)
        elif not self._lc.llama_memory_seq_rm(self._mem, seq, n_keep, -1):
            raise UnsupportedModelError(f"llama.cpp refused to remove KV entries after position {n_keep} for {self.path.name}")
        self.seq_len[seq] = n_keep
        self.writes[seq] += 1

    def can_truncate(self, n_keep: int, seq: int = 0) -> bool:
        """Whether ``truncate(n_keep, seq)`` would succeed (always, for attention-only models)."""
        if not self.is_recurrent or n_keep >= self.seq_len[seq]:
            return True
        log = self._logs[seq]
        try:
            plan_cut(log, self.seq_len[seq] + log.phantom, n_keep, self.strategy, self.rollback_depth)
        except UnsupportedModelError:
            return False
        return True

    def _cut_recurrent(self, n_keep: int, seq: int) -> None:
        log, lc = self._logs[seq], self._lc
        how = plan_cut(log, self.seq_len[seq] + log.phantom, n_keep, self.strategy, self.rollback_depth)
        if how == "rollback":
            t0 = time.perf_counter()
            self._roll_back(seq, n_keep)
            if log.ckpt is not None:
                del log.since[n_keep - log.ckpt_pos:]
            self.rewind.rollbacks += 1
            self.rewind.seconds += time.perf_counter() - t0
            return
        t0 = time.perf_counter()
        assert log.ckpt is not None
        if int(lc.llama_state_seq_set_data_ext(self._ctx, log.ckpt, len(log.ckpt), seq, _PARTIAL)) == 0:
            raise RollbackError(f"llama.cpp could not restore a checkpoint of {self.path.name}")
        # Attention KV (hybrids) is cut by position; the recurrent part now ends at the checkpoint.
        lc.llama_memory_seq_rm(self._mem, seq, log.ckpt_pos, -1)
        redo = log.since[: n_keep - log.ckpt_pos]
        self.seq_len[seq] = log.ckpt_pos
        log.since, log.last_call, log.rolled, log.phantom = [], 0, False, 0
        if redo:
            # Re-decoded as a verification call would be (padded alike, logits asked for), so the state
            # is computed by the kernels that measured exact, and no new graph shape is built.
            pad = max(0, self.min_batch - len(redo))
            self._call([(seq, redo, pad, 0)])
        self.rewind.restores += 1
        self.rewind.redecoded += len(redo)
        self.rewind.seconds += time.perf_counter() - t0

    def _roll_back(self, seq: int, n_keep: int) -> None:
        """llama.cpp's rollback to ``n_keep`` tokens (``plan_cut`` has checked it may); drops phantom pads too."""
        log = self._logs[seq]
        if not self._lc.llama_memory_seq_rm(self._mem, seq, n_keep, -1):
            raise RollbackError(f"llama.cpp refused to roll {self.path.name} back to {n_keep} tokens")
        log.last_call -= self.seq_len[seq] + log.phantom - n_keep
        log.rolled, log.phantom = True, 0

    def _settle(self, seq: int) -> None:
        """Roll phantom pad rows out of ``seq``'s state before anything else reads or extends it."""
        log, n = self._logs[seq], self.seq_len[seq]
        if log.phantom:
            if plan_cut(log, n + log.phantom, n, self.strategy, self.rollback_depth) == "rollback":
                self._roll_back(seq, n)
            else:
                self._cut_recurrent(n, seq)

    def checkpoint(self, seq: int = 0) -> None:
        """Save ``seq``'s recurrent state so a later ``truncate`` can come back to here (no-op without one)."""
        if not self.is_recurrent:
            return
        self._settle(seq)
        log, lc = self._logs[seq], self._lc
        if log.ckpt is not None and log.ckpt_pos == self.seq_len[seq] and not log.since:
            return
        t0 = time.perf_counter()
        size = int(lc.llama_state_seq_get_size_ext(self._ctx, seq, _PARTIAL))
        buf = log.ckpt if log.ckpt is not None and len(log.ckpt) == size else (ctypes.c_uint8 * size)()
        n = int(lc.llama_state_seq_get_data_ext(self._ctx, buf, size, seq, _PARTIAL))
        if n != size:
            log.forget()
            raise RollbackError(f"llama.cpp could not save the recurrent state of {self.path.name} "
                                f"({self.memory}); it can neither roll back nor checkpoint it: use --drafter none")
        # The ctypes buffer itself is kept (and reused): a copy into bytes would cost more than the save.
        log.ckpt, log.ckpt_pos, log.since = buf, self.seq_len[seq], []
        self.rewind.checkpoints += 1
        self.rewind.seconds += time.perf_counter() - t0

    def protect(self, seq: int, n: int, one_call: bool = True) -> None:
        """About to append ``n`` tokens that may be cut again: checkpoint unless a rollback will reach them."""
        if needs_checkpoint(self._logs[seq], n, self.strategy, self.rollback_depth, one_call and n <= self.shapes.max_rows):
            self.checkpoint(seq)

    def save_seq(self, seq: int) -> bytes:
        """A copy of one sequence's KV cache (llama.cpp's per-sequence state), for a host-memory prompt cache."""
        lc = self._lc
        if self.is_recurrent:
            self._settle(seq)
        size = int(lc.llama_state_seq_get_size(self._ctx, seq))
        buf = (ctypes.c_uint8 * size)()
        n = int(lc.llama_state_seq_get_data(self._ctx, buf, size, seq))
        return ctypes.string_at(buf, n)

    def load_seq(self, seq: int, data: bytes, n_tokens: int) -> bool:
        """Replace ``seq``'s KV with a saved copy of ``n_tokens`` positions; False if llama.cpp refuses it."""
        lc = self._lc
        self.reset(seq)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if int(lc.llama_state_seq_set_data(self._ctx, buf, len(data), seq)) == 0:
            self.reset(seq)
            return False
        self.seq_len[seq] = n_tokens
        self.writes[seq] += 1
        return True

    def seq_pos_max(self, seq: int = 0) -> int:
        """The last position llama.cpp holds for ``seq`` (-1 when empty): checks that cells were freed."""
        return int(self._lc.llama_memory_seq_pos_max(self._mem, seq))

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
        chunk = max(1, min(self.config.prefill_chunk, self._batch_cap))
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
        if len(segments) > 1 and self.is_recurrent:
            # One call per sequence: a recurrent ubatch needs equal rows per sequence, and
            # padding rows on the sequence itself would advance its state.
            return [None if (r := self.decode([seg])[0]) is None else r.copy() for seg in segments]
        if len(segments) == 1 and len(segments[0].tokens) <= self.shapes.max_rows:  # the common case, no planning
            s = segments[0]
            n = len(s.tokens)
            pad = max(0, min(self.min_batch - n, self.n_ctx - self.seq_len[s.seq] - n))
            return self._call([(s.seq, list(s.tokens), pad, s.logits_from)])
        rows = [len(s.tokens) for s in segments]
        seqs = [s.seq for s in segments]
        room = [self.n_ctx - self.seq_len[s.seq] - len(s.tokens) for s in segments]
        calls = plan_calls(rows, seqs, self.shapes.min_rows, self.shapes.max_rows, room)
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

    def _call(self, entries: Sequence[tuple[int, list[int], int, int]]) -> list[np.ndarray | None]:
        """One ``llama_decode``: per entry (seq, tokens, pad, logits_from) the tokens then ``pad`` copies of the last.

        Pads are dropped from the KV cache right after; causal attention means
        they cannot change the real rows.  A recurrent model's pads would advance
        its state: they stay as phantoms rolled back with the next cut (rollback)
        or go to the scratch sequence (checkpoint); see ``_init_rewind``.  Output rows: on an exact target
        every row of the call (pads too) when any entry wants logits, else
        none; otherwise just each entry's rows from ``logits_from``.  Returns
        per entry the logits of its rows from ``logits_from`` (None if none).
        """
        lc, b = self._lc, self._batch
        if self.is_recurrent:
            for seq, *_ in entries:
                self._settle(seq)
        exact = self.config.exact
        all_out = exact and any(f < len(t) for _, t, _, f in entries)
        m = out_row = 0
        where: list[int | None] = []  # output row of each entry's first wanted row
        scratch = self._scratch
        for seq, toks, pad, first in entries:
            n = len(toks) + pad
            wanted = first < len(toks)
            where.append((out_row + first if all_out else out_row) if wanted else None)
            out_row += n if all_out else (len(toks) - first if wanted and not exact else 0)
            start = self.seq_len[seq]
            self._b_token[m : m + len(toks)] = toks
            self._b_token[m + len(toks) : m + n] = toks[-1]
            self._b_pos[m : m + n] = np.arange(start, start + n, dtype=np.int32)
            if scratch >= 0 and pad:  # pads of a recurrent model: the scratch sequence, from position 0
                self._b_pos[m + len(toks) : m + n] = np.arange(pad, dtype=np.int32)
            if all_out:
                self._b_logits[m : m + n] = 1
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
        rc = lc.llama_decode(self._ctx, b)
        if rc != 0:
            raise ContextOverflowError(
                f"llama_decode failed (code {rc}) on {m} tokens of {self.path.name}; "
                "the KV cache may be full: use a larger --ctx-size or a shorter prompt"
            )
        for seq, toks, pad, _ in entries:
            self.seq_len[seq] += len(toks)
            self.writes[seq] += 1
            if self.is_recurrent:
                self._logs[seq].appended(toks, pad if scratch < 0 else 0)
                if pad and scratch >= 0:
                    lc.llama_memory_seq_rm(self._mem, scratch, -1, -1)
            elif pad:
                lc.llama_memory_seq_rm(self._mem, seq, self.seq_len[seq], -1)
        if out_row == 0:
            return [None] * len(entries)
        logits = np.ctypeslib.as_array(lc.llama_get_logits(self._ctx), shape=(out_row, self.n_vocab))
        return [None if w is None else logits[w : w + len(t) - f] for w, (_, t, _, f) in zip(where, entries)]

    def raw_call(self, tokens: Sequence[int], outputs: bool = True, seq: int = 0, pad: int = 0) -> np.ndarray:
        """One unsplit call, padded by ``pad`` rows only (shape measurement and cost curves need exact shapes)."""
        self._check_room(seq, len(tokens) + pad)
        rows = self._call([(seq, list(tokens), pad, 0 if outputs else len(tokens))])[0]
        return rows if rows is not None else np.empty((0, self.n_vocab), dtype=np.float32)

    # -- tree batches ------------------------------------------------------

    def eval_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Evaluate a token tree in one batch on sequence 0; return logits for every node, [n, V].

        ``tokens[0]`` is the root (the pending token, at position n_past);
        ``parents[i] < i`` is node i's parent (``parents[0] == -1``).  Each
        root-to-leaf branch is one llama.cpp sequence; a node belongs to the
        sequences of every branch through it, and the cached prefix is first
        shared with all of them (``seq_cp``).  Call ``commit_tree`` next.
        Only a one-slot (unified) target has branch sequences.
        """
        n = len(tokens)
        if self.is_recurrent:
            raise ValueError(f"{self.path.name} is {self.memory}: a tree needs one recurrent state per branch; verify chains")
        if n < 2 or n > self._batch_cap or self.n_past + n > self.capacity:
            raise ValueError(f"tree of {n} tokens does not fit (batch {self._batch_cap}, context {self.capacity - self.n_past} left)")
        depth = [0] * n
        has_child = [False] * n
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
            has_child[parents[i]] = True
        leaves = [i for i in range(n) if not has_child[i]]
        if not self.unified or len(leaves) > self.n_seq_max:
            raise ValueError(f"tree has {len(leaves)} branches but the context allows {self.n_seq_max if self.unified else 1}")
        seqs: list[list[int]] = [[] for _ in range(n)]
        for s, leaf in enumerate(leaves):
            i = leaf
            while i >= 0:
                seqs[i].append(s)
                i = parents[i]
        mem, lc, b = self._mem, self._lc, self._batch
        for s in range(1, len(leaves)):
            lc.llama_memory_seq_cp(mem, 0, s, -1, -1)
        start = self.n_past
        self._b_token[:n] = tokens
        self._b_pos[:n] = [start + d for d in depth]
        self._b_logits[:n] = 1
        for i in range(n):
            b.n_seq_id[i] = len(seqs[i])
            for j, s in enumerate(seqs[i]):
                b.seq_id[i][j] = s
            self._b_seq0[i] = seqs[i][0]
        b.n_tokens = n
        rc = lc.llama_decode(self._ctx, b)
        self._tree = (start, seqs, len(leaves))
        self._tree_tokens = list(tokens)
        if rc != 0:
            self.commit_tree([0])
            raise ContextOverflowError(f"llama_decode failed (code {rc}) on a tree of {n} tokens")
        self.n_past = start + max(depth) + 1
        return np.ctypeslib.as_array(lc.llama_get_logits(self._ctx), shape=(n, self.n_vocab))

    def commit_tree(self, path: Sequence[int]) -> None:
        """Keep only the KV entries of ``path`` (node indices from the root, ``path[0] == 0``).

        Attention sums over KV cells in cell order, so the cache must end up
        laid out as if the path had been decoded as a chain, or later logits
        drift (~1e-3) from plain decoding.  Nodes occupy cells in batch
        order: a path ``0, 1, ..., m`` (the first depth-first branch, which
        drafters make the most likely one) is already contiguous.  Any other
        path is re-decoded as a chain, costing one extra batch.
        """
        start, seqs, n_branches = self._tree
        self._tree = None
        self._restore_batch(len(seqs))
        mem, lc = self._mem, self._lc
        for s in range(1, n_branches):
            lc.llama_memory_seq_rm(mem, s, -1, -1)
        self.n_past = max(self.n_past, start + len(path))
        if list(path) == list(range(len(path))):
            self.truncate(start + len(path))
            return
        tokens = [self._tree_tokens[i] for i in path]
        self.truncate(start)
        self.tree_relayouts += 1
        self.decode([Segment(0, tokens, len(tokens))])  # decode-class calls, as a chain step would be

    def _restore_batch(self, n: int) -> None:
        """Back to one sequence per row, as ``_call`` assumes."""
        b = self._batch
        for i in range(n):
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            self._b_seq0[i] = 0

    # -- vocabulary --------------------------------------------------------

    def tokenize(self, text: str | bytes, add_special: bool = True) -> list[int]:
        """Text (or raw UTF-8 bytes) to token ids; ``add_special`` adds BOS when the model asks for it."""
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        cap = len(data) + 8
        buf = (ctypes.c_int32 * cap)()
        n = self._lc.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, False)
        if n < 0:
            cap = -n
            buf = (ctypes.c_int32 * cap)()
            n = self._lc.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, False)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token's text (cached: called for every output token)."""
        piece = self._piece_cache.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = self._lc.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self._lc.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
            piece = buf.raw[:n]
            self._piece_cache[token] = piece
        return piece

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        """End of generation (EOS, EOT, ...) as the model's vocabulary defines it."""
        return bool(self._lc.llama_vocab_is_eog(self._vocab, token))

    def eog_ids(self) -> frozenset[int]:
        """All end-of-generation ids, computed once so the loop tests set membership."""
        if not hasattr(self, "_eog"):
            self._eog = frozenset(t for t in range(self.n_vocab) if self.is_eog(t))
        return self._eog


class VocabModel:
    """A GGUF's tokenizer alone (llama.cpp's vocab-only load: no weights, no context)."""

    def __init__(self, path: str | Path, role: str = "tokenizer model") -> None:
        self.path = check_gguf_file(path, role)
        _init_backend()
        self._lc = lc = _llama()
        params = lc.llama_model_default_params()
        params.vocab_only = True
        self._model = lc.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ModelLoadError(f"cannot load the tokenizer of {self.path}")
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self._vocab))

    tokenize = LlamaModel.tokenize

    def close(self) -> None:
        if getattr(self, "_model", None):
            self._lc.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def quantize(src: Path, out: Path, ftype: str, *, threads: int = 2) -> int:
    """llama.cpp's own quantizer (``llama_model_quantize``); ftype "q8_0" or "q4_k_m". Returns its code."""
    lc = _llama()
    _init_backend()
    ftypes = {"q8_0": lc.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_k_m": lc.LLAMA_FTYPE_MOSTLY_Q4_K_M}
    if ftype not in ftypes:
        raise UnsupportedModelError(f"cannot quantize to {ftype!r}; choose one of {', '.join(ftypes)}")
    params = lc.llama_model_quantize_default_params()
    params.ftype = ftypes[ftype]
    params.nthread = threads
    return int(lc.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)))


def llama_version() -> str | None:
    """llama-cpp-python's version, or None when it cannot be imported (never raises)."""
    try:
        return getattr(_llama(), "__version__", None)
    except Exception:  # noqa: BLE001 - doctor and bench report it, they must not fail on it
        return None


def llama_system_info() -> tuple[str | None, str | None]:
    """(llama.cpp's system info line, error): never raises, for doctor and bench."""
    try:
        return system_info().strip(), None
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"


def system_info() -> str:
    """llama.cpp's build and CPU feature line (AVX2, AVX512, ...)."""
    _init_backend()
    return _llama().llama_print_system_info().decode(errors="replace")
