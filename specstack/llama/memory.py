"""The sequences of a ``LlamaModel``: reset, truncate, and cutting back recurrent state.

Attention KV is cut by position.  A recurrent or hybrid model's state is
rolled back by llama.cpp (``n_rs_seq``) or restored from a checkpoint and
re-decoded; ``recurrent.plan_cut`` decides which, and this module carries it
out.  Host-memory copies of a sequence (the prompt cache) live here too.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import UnsupportedModelError
from .target import ModelConfig
from .batching import BatchShapes
from .recurrent import Memory, RollbackError, RewindStats, SeqLog, Strategy, needs_checkpoint, plan_cut

_PARTIAL = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: just the recurrent part of a sequence's state


class SequenceMemory:
    """``LlamaModel``'s sequence and state operations (a mixin: it uses the model's context and logs)."""

    # Set by ``LlamaModel.__init__`` (``model.py``); declared here so the contract is visible.
    _lc: Any  # the llama_cpp module
    _ctx: Any
    _mem: Any
    _model: Any
    _logs: list[SeqLog]
    config: ModelConfig
    path: Path
    memory: Memory
    is_recurrent: bool
    n_seq_max: int
    seq_len: list[int]
    writes: list[int]
    shapes: BatchShapes
    min_batch: int
    _call: Callable[..., list]
    close: Callable[[], None]
    _cut_hidden: Callable[[int, int], None]  # ``hidden.HiddenStates``: staged hidden rows follow every cut
    _drop_hidden: Callable[..., None]

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

    def reset(self, seq: int | None = None) -> None:
        """Forget the whole KV cache, or one sequence's part of it."""
        self._drop_hidden(seq)
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
        self._cut_hidden(seq, n_keep)
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
        self.reset(seq)  # drops its hidden rows too: the copy brings none
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
