"""Token trees in one llama.cpp batch: each root-to-leaf branch is a sequence sharing the cached prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ContextOverflowError
from .batching import Segment
from .recurrent import Memory


class TreeBatches:
    """``LlamaModel``'s tree verification (a mixin: it uses the model's batch and sequences)."""

    # Set by ``LlamaModel.__init__`` (``model.py``); declared here so the contract is visible.
    _lc: Any  # the llama_cpp module
    _ctx: Any
    _mem: Any
    _batch: Any
    _batch_cap: int
    _b_token: np.ndarray
    _b_pos: np.ndarray
    _b_logits: np.ndarray
    _b_seq0: list[int]
    path: Path
    memory: Memory
    is_recurrent: bool
    unified: bool
    n_slots: int
    n_seq_max: int
    n_vocab: int
    capacity: int
    n_past: int
    tree_relayouts: int
    truncate: Callable[..., None]
    decode: Callable[..., list]

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
        if not self.unified or self.n_slots > 1 or len(leaves) > self.n_seq_max:  # branches would be other slots
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
