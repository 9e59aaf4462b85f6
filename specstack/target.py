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
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .errors import ContextOverflowError, ModelLoadError, UnsupportedModelError

_GGUF_MAGIC = b"GGUF"
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


@dataclass(frozen=True)
class ModelConfig:
    """How to load a model.  n_ctx 0 means the model's trained context length."""

    path: Path
    n_ctx: int = 0
    n_threads: int = 0  # 0 = physical cores
    n_batch: int = 512
    # Pad every evaluation to at least this many tokens.  Measured in this
    # build: logits are bit-identical for any batch of 2..63 tokens but differ
    # (up to ~0.005) for a batch of 1, which flipped 4 of 2400 greedy argmaxes.
    # With min_batch=2, plain and speculative decoding compute identically.
    min_batch: int = 2
    # Branches a tree draft may have (llama.cpp sequences).  Measured: a
    # unified KV cache with several sequences gives bit-identical chain
    # logits to a single-sequence context, so exactness is unaffected.
    n_seq_max: int = 1
    # llama.cpp's "auto" enables flash attention on CPU; for small models and
    # short contexts the plain attention path was faster here (see README).
    flash_attn: bool = False
    kv_overrides: tuple[tuple[str, int], ...] = ()


def default_threads() -> int:
    """Physical cores: llama.cpp decoding gains nothing from SMT siblings."""
    try:
        from .sysinfo import physical_cores

        return max(1, physical_cores())
    except Exception:  # sysinfo missing or unreadable /proc: fall back
        import os

        return max(1, os.cpu_count() or 1)


class LlamaModel:
    """One GGUF model with a single-sequence context on llama.cpp.

    Invariant: the KV cache holds exactly ``self.n_past`` tokens at positions
    0..n_past-1 of sequence 0; ``eval`` appends, ``truncate`` drops a tail.
    """

    def __init__(self, config: ModelConfig, role: str = "model") -> None:
        self.config = config
        self.role = role
        self.path = check_gguf_file(config.path, role)
        _init_backend()
        self._lc = lc = _llama()
        self._model = self._load_model()
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(lc.llama_model_n_ctx_train(self._model))
        self.is_recurrent = bool(lc.llama_model_is_recurrent(self._model) or lc.llama_model_is_hybrid(self._model))
        self.n_threads = config.n_threads or default_threads()
        self._ctx = self._new_context()
        self.n_ctx = int(lc.llama_n_ctx(self._ctx))
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch_cap = max(1, min(config.n_batch, self.n_ctx))
        self.min_batch = max(1, min(config.min_batch, self._batch_cap))
        # Positions usable by real tokens: padding needs min_batch - 1 spare slots.
        self.capacity = self.n_ctx - (self.min_batch - 1)
        self.n_seq_max = max(1, config.n_seq_max)
        self._batch = lc.llama_batch_init(self._batch_cap, 0, self.n_seq_max)
        self._init_batch_views()
        self.n_past = 0
        self.tree_relayouts = 0  # tree paths that had to be re-decoded to keep exact KV layout
        self._piece_cache: dict[int, bytes] = {}
        self.bos_id = int(lc.llama_vocab_bos(self._vocab))
        self.eos_id = int(lc.llama_vocab_eos(self._vocab))
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self._vocab))

    # -- loading -----------------------------------------------------------

    def _load_model(self):
        lc = self._lc
        params = lc.llama_model_default_params()
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
        params.n_ctx = self.config.n_ctx or self.n_ctx_train
        params.n_batch = params.n_ubatch = max(1, min(self.config.n_batch, params.n_ctx))
        params.n_threads = params.n_threads_batch = self.n_threads
        params.n_seq_max = max(1, self.config.n_seq_max)
        params.kv_unified = True  # tree branches share the cached prefix
        params.flash_attn_type = 1 if self.config.flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        params.no_perf = True
        ctx = lc.llama_init_from_model(self._model, params)
        if not ctx:
            lc.llama_model_free(self._model)
            raise ModelLoadError(f"llama.cpp could not create a context for {self.path} (n_ctx={params.n_ctx}); try a smaller --ctx-size")
        return ctx

    def _init_batch_views(self) -> None:
        """numpy views over the batch arrays: filling a batch is then vectorised."""
        b, n = self._batch, self._batch_cap
        self._b_token = np.ctypeslib.as_array(b.token, shape=(n,))
        self._b_pos = np.ctypeslib.as_array(b.pos, shape=(n,))
        self._b_logits = np.ctypeslib.as_array(b.logits, shape=(n,))
        n_seq = np.ctypeslib.as_array(b.n_seq_id, shape=(n,))
        n_seq[:] = 1
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

    # -- evaluation --------------------------------------------------------

    def reset(self) -> None:
        """Forget the whole KV cache."""
        self._lc.llama_memory_clear(self._mem, True)
        self.n_past = 0

    def truncate(self, n_keep: int) -> None:
        """Drop KV entries from position ``n_keep`` on (rollback after a rejection)."""
        if n_keep >= self.n_past:
            return
        if self.is_recurrent:
            raise UnsupportedModelError(
                f"{self.path.name} is a recurrent/hybrid model: its state cannot be rolled back, so it "
                "cannot be used for speculation yet; use --drafter none"
            )
        if not self._lc.llama_memory_seq_rm(self._mem, 0, n_keep, -1):
            raise UnsupportedModelError(f"llama.cpp refused to remove KV entries after position {n_keep} for {self.path.name}")
        self.n_past = n_keep

    def eval(self, tokens: Sequence[int], logits_from: int | None = None) -> np.ndarray:
        """Append ``tokens`` at positions n_past.. and return logits for rows logits_from..end.

        Returns a [n_rows, n_vocab] float32 array that is a *view* of
        llama.cpp's buffer, valid until the next eval (copy it to keep it).
        ``logits_from=None`` means only the last row; ``len(tokens)`` means none.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("eval needs at least one token")
        if n < self.min_batch:
            return self._eval_padded(tokens, n - 1 if logits_from is None else logits_from)
        if self.n_past + n > self.n_ctx:
            raise ContextOverflowError(
                f"{self.role} context is full: {self.n_past} + {n} tokens > n_ctx {self.n_ctx}; "
                "use a shorter prompt, fewer max tokens or a larger --ctx-size"
            )
        wanted = n - 1 if logits_from is None else logits_from
        # Ask for at least min_batch output rows: one output row runs another kernel (see _eval_padded).
        first = max(0, min(wanted, n - self.min_batch)) if wanted < n else wanted
        for start in range(0, n, self._batch_cap):
            chunk = tokens[start : start + self._batch_cap]
            self._decode_chunk(chunk, max(0, first - start))
        n_rows = n - first
        if n_rows <= 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        ptr = self._lc.llama_get_logits(self._ctx)
        # Outputs are only those of the last chunk, in batch order.
        last_chunk = n - (n - 1) // self._batch_cap * self._batch_cap
        if n_rows > last_chunk:
            raise ValueError(f"can return logits for at most the last {last_chunk} of {n} tokens")
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_vocab))[wanted - first :]

    def _eval_padded(self, tokens: Sequence[int], logits_from: int) -> np.ndarray:
        """Evaluate a short batch padded with throw-away tokens, then drop them from the KV cache.

        Causal attention means the pad rows cannot change the real rows, and
        the real rows are computed by the same kernels as any longer batch.
        The pad rows also get (ignored) logits: the output projection runs
        a different kernel for a single output row, which would change the
        real row's logits by up to ~1e-3.
        """
        n = len(tokens)
        if self.n_past + self.min_batch > self.n_ctx:
            raise ContextOverflowError(
                f"{self.role} context is full: {self.n_past} + {n} tokens (+{self.min_batch - n} padding) > n_ctx {self.n_ctx}"
            )
        padded = list(tokens) + [tokens[-1]] * (self.min_batch - n)
        start = self.n_past
        first = min(logits_from, n - 1)
        self._decode_chunk(padded, first)
        self._lc.llama_memory_seq_rm(self._mem, 0, start + n, -1)
        self.n_past = start + n
        ptr = self._lc.llama_get_logits(self._ctx)
        rows = np.ctypeslib.as_array(ptr, shape=(len(padded) - first, self.n_vocab))
        return rows[logits_from - first : n - first]

    def _decode_chunk(self, chunk: Sequence[int], logits_from: int) -> None:
        m = len(chunk)
        self._b_token[:m] = chunk
        self._b_pos[:m] = np.arange(self.n_past, self.n_past + m, dtype=np.int32)
        self._b_logits[:m] = 0
        if logits_from < m:
            self._b_logits[logits_from:m] = 1
        self._batch.n_tokens = m
        rc = self._lc.llama_decode(self._ctx, self._batch)
        if rc != 0:
            raise ContextOverflowError(
                f"llama_decode failed (code {rc}) on {m} tokens at position {self.n_past} of {self.path.name}; "
                "the KV cache may be full: use a larger --ctx-size or a shorter prompt"
            )
        self.n_past += m

    # -- tree batches ------------------------------------------------------

    def eval_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Evaluate a token tree in one batch; return logits for every node, [n, V].

        ``tokens[0]`` is the root (the pending token, at position n_past);
        ``parents[i] < i`` is node i's parent (``parents[0] == -1``).  Each
        root-to-leaf branch is one llama.cpp sequence; a node belongs to the
        sequences of every branch through it, and the cached prefix is first
        shared with all of them (``seq_cp``).  Call ``commit_tree`` next.
        """
        n = len(tokens)
        if n < 2 or n > self._batch_cap or self.n_past + n > self.capacity:
            raise ValueError(f"tree of {n} tokens does not fit (batch {self._batch_cap}, context {self.capacity - self.n_past} left)")
        depth = [0] * n
        has_child = [False] * n
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
            has_child[parents[i]] = True
        leaves = [i for i in range(n) if not has_child[i]]
        if len(leaves) > self.n_seq_max:
            raise ValueError(f"tree has {len(leaves)} branches but the context allows {self.n_seq_max}")
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
        self.eval(tokens, logits_from=len(tokens))

    def _restore_batch(self, n: int) -> None:
        """Back to the single-sequence layout that eval() assumes."""
        b = self._batch
        for i in range(n):
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0

    # -- vocabulary --------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Text to token ids; ``add_special`` adds BOS when the model asks for it."""
        data = text.encode("utf-8")
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

    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        self._lc.llama_model_desc(self._model, buf, 256)
        return buf.value.decode(errors="replace")


def system_info() -> str:
    """llama.cpp's build and CPU feature line (AVX2, AVX512, ...)."""
    _init_backend()
    return _llama().llama_print_system_info().decode(errors="replace")
