"""Recurrent and hybrid models: how rejected draft tokens leave a state that cannot simply be cut.

Attention KV is stored per position, so dropping a tail is free.  A recurrent
layer (Mamba, RWKV, LFM2's short convolution) keeps one state per sequence
that summarises every token so far.  llama.cpp offers two ways back, and
``target.LlamaModel`` uses whichever this module plans:

- **rollback**: a context made with ``n_rs_seq > 0`` keeps snapshots of the
  state before each of the last call's trailing tokens, and ``seq_rm``
  selects one (only on architectures where ``llm_arch_supports_rs_rollback``;
  llama.cpp silently clamps ``n_rs_seq`` to 0 elsewhere).  Measured here on
  llama-cpp-python 0.3.36: a rollback is valid only within the *last call*
  into that sequence and at most ``n_rs_seq`` tokens back; a second
  ``seq_rm`` before the next decode returns False; and one deeper than the
  last call returns **True with a stale state**.  So the checks live here,
  not in llama.cpp.
- **checkpoint**: save the sequence's recurrent state
  (``llama_state_seq_get_data_ext`` with ``PARTIAL_ONLY``; attention KV is
  still cut by position) before a batch that may be rejected; after a partial
  acceptance restore it and re-decode the accepted tokens.  It works on every
  recurrent architecture, at the price of a copy per step and a re-decode per
  rejection.

A cut neither can serve raises ``RollbackError``: output is never silently
computed from a wrong state.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from ..errors import UnsupportedModelError

STRATEGIES = ("auto", "rollback", "checkpoint")
DEFAULT_DEPTH = 17  # n_rs_seq: drafts of up to 16 tokens roll back without a checkpoint

Memory = Literal["attention", "recurrent", "hybrid"]
Strategy = Literal["truncate", "rollback", "checkpoint"]


class RollbackError(UnsupportedModelError):
    """A recurrent state cannot be brought back to the position asked for."""


@dataclass
class SeqLog:
    """What one sequence's recurrent state can be brought back to."""

    last_call: int = 0  # tokens the last call appended (a rollback reaches back at most last_call - 1)
    rolled: bool = False  # a rollback since that call: llama.cpp allows one
    ckpt_pos: int = -1  # position of the saved state (-1: none)
    ckpt: Any = None  # the saved state: a ctypes byte array owned by the target
    since: list[int] = field(default_factory=list)  # tokens appended after the checkpoint, to re-decode
    phantom: int = 0  # padding rows still in the state after the real tokens (rolled back with the next cut)

    def appended(self, tokens: list[int], pad: int = 0) -> None:
        """One call appended ``tokens`` and then ``pad`` padding rows to this sequence."""
        self.last_call, self.phantom, self.rolled = len(tokens) + pad, pad, False
        if self.ckpt is not None:
            self.since.extend(tokens)

    def forget(self) -> None:
        self.last_call, self.rolled, self.phantom = 0, False, 0
        self.ckpt_pos, self.ckpt, self.since = -1, None, []


@dataclass
class RewindStats:
    """Counts and seconds of what cutting recurrent state cost (what a step pays beyond its batch)."""

    rollbacks: int = 0
    checkpoints: int = 0
    restores: int = 0
    redecoded: int = 0  # tokens decoded again after a restore
    seconds: float = 0.0  # saving, restoring and re-decoding

    def copy(self) -> RewindStats:
        return replace(self)

    def add_change(self, now: RewindStats, before: RewindStats) -> None:
        """Add what ``now`` counts beyond ``before`` (a target's totals around one call)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(now, f.name) - getattr(before, f.name))

    def to_dict(self) -> dict:
        return {"rollbacks": self.rollbacks, "checkpoints": self.checkpoints, "restores": self.restores,
                "redecoded_tokens": self.redecoded, "seconds": round(self.seconds, 6)}


def plan_cut(log: SeqLog, length: int, n_keep: int, strategy: Strategy, depth: int) -> Literal["rollback", "restore"]:
    """How to bring a sequence holding ``length`` tokens back to ``n_keep`` tokens, or raise RollbackError."""
    back = length - n_keep
    if strategy == "rollback" and not log.rolled and 0 < back < log.last_call and back <= depth:
        return "rollback"
    if log.ckpt is not None and log.ckpt_pos <= n_keep <= log.ckpt_pos + len(log.since):
        return "restore"
    why = ("a rollback was already used since the last call" if log.rolled else
           f"{back} tokens reaches past the first token of the last call ({log.last_call} tokens) or n_rs_seq ({depth})"
           if strategy == "rollback" else "no checkpoint covers that position")
    raise RollbackError(f"cannot cut a recurrent state from {length} back to {n_keep} tokens: {why}. "
                        "This is a bug in the caller (a checkpoint should have been taken); please report it")


def needs_checkpoint(log: SeqLog, n: int, strategy: Strategy, depth: int, one_call: bool) -> bool:
    """Before appending ``n`` tokens of which all but the first may be cut again: is a saved state needed?"""
    if strategy == "truncate" or n <= 1:
        return False
    if strategy == "rollback" and one_call and n - 1 <= depth:
        return False
    return True
