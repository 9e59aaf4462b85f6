"""A suffix tree with occurrence counts over token sequences, for SuffixDecoding.

SuffixDecoding (Oliaro et al., arXiv 2411.04975), shaped like ArcticInference's
``suffix_tree.cc``: a path-compressed trie of every suffix of one or more
sequences, each cut at ``max_depth`` tokens.  A node's ``count`` is the number of
suffixes passing through it, which is the number of occurrences of the node's
path, so ``child.count / node.count`` estimates P(next token | matched text).

Appending a token costs O(max_depth): each sequence keeps its *active* nodes
(where its suffixes of length 1..max_depth currently end) and extends each by
the new token.  Nothing is rebuilt per step.

This module changes the tree and answers one-shot queries; ``suffix_match``
streams a context's matches, ``suffix_draft`` drafts from them and
``suffix_tree_file`` is the on-disk format.
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from . import suffix_tree_file
from .suffix_node import Node, State, best_child, repoint

__all__ = ["SuffixTree"]


class SuffixTree:
    """Counts every substring (up to ``max_depth`` tokens) of a set of token sequences.

    Example: after ``extend(0, [1, 2, 3, 1, 2, 4])``, ``count([1, 2]) == 2`` and
    ``next_counts([1, 2]) == {3: 1, 4: 1}``; ``suffix_draft.propose(tree, [5, 1], 3)``
    matches ``[1]`` (m=1, so at most 1 token with max_spec_factor=1) and drafts
    ``[2]`` with probability 1.0.

    Sequences are identified by integer ids; several may be open at once (each
    keeps its own active nodes).  ``remove`` deletes a whole sequence; it is
    cheapest when sequences are removed in the order they were added (FIFO),
    which is how the suffix drafter evicts.
    """

    def __init__(self, max_depth: int = 64) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1 (got {max_depth})")
        self.max_depth = int(max_depth)
        self._root = Node(0, None, -1, 0, 0)
        self._root.children = {}
        self._seqs: dict[int, array] = {}  # int32 token arrays: 4 bytes a token
        # _active[seq][i]: node where that sequence's suffix of length i+1 ends.
        self._active: dict[int, list[Node]] = {}
        self._num_tokens = 0
        self.version = 0  # bumped on every change; matchers resync when it moves

    # --- contents ---------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        """Tokens over all sequences (the memory bound the drafter enforces)."""
        return self._num_tokens

    def seq_ids(self) -> list[int]:
        """Sequence ids in the order they were added."""
        return list(self._seqs)

    def sequence(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id])

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def root(self) -> Node:
        """The root node, where every match starts (read-only: for matchers and drafting)."""
        return self._root

    @property
    def texts(self) -> Mapping[int, array]:
        """Sequence id -> its token array, which node labels point into (read-only)."""
        return self._seqs

    # --- appending --------------------------------------------------------------------
    def extend(self, seq_id: int, token_ids: Iterable[int]) -> None:
        for t in token_ids:
            self.append(seq_id, t)

    def append(self, seq_id: int, token: int) -> None:
        """Append ``token`` to sequence ``seq_id`` (created if new); O(max_depth)."""
        token = int(token)
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = array("i")
            act = self._active[seq_id] = []
        else:
            act = self._active.get(seq_id)  # type: ignore[assignment]
            if act is None:
                raise ValueError(f"sequence {seq_id} is closed; it cannot grow")
        seqs = self._seqs
        pos = len(seq)
        seq.append(token)
        self._num_tokens += 1
        self.version += 1
        root = self._root
        root.count += 1  # the new, empty suffix starts at the root
        act.insert(0, root)
        if len(act) > self.max_depth:
            act.pop()  # that suffix reached max_depth: it ends where it is, for good
        for i, node in enumerate(act):
            # Our suffix ends at the end of `node`; extend it by `token`.
            children = node.children
            ch = children.get(token) if children else None
            if ch is None:
                if node.count == 1 and node is not root:
                    # Only our suffix reaches `node`, so it is a leaf of ours: grow its label.
                    node.length += 1
                    node.seq = seq_id
                    node.start = pos + 1 - node.length
                    continue  # act[i] stays `node`
                new = Node(1, node, seq_id, pos, 1)
                if children is None:
                    node.children = {token: new}
                else:
                    children[token] = new
                b = node.best
                if b is None or (b.count == 1 and token < seqs[b.seq][b.start]):
                    node.best = new
                act[i] = new
            elif node.count == ch.count + 1 and node is not root:
                # Ours is the only suffix ending at `node` and all others go on to `ch`:
                # after the move `node` would have one child of equal count, so fuse.
                if ch.length == 1:
                    ch.count += 1
                    ch.seq, ch.start = seq_id, pos  # its one token, in our sequence
                    self._merge_into_child(node, ch)
                    act[i] = ch
                else:
                    # `node` takes over the first token of `ch`.
                    node.length += 1
                    node.seq = seq_id
                    node.start = pos + 1 - node.length
                    del children[token]  # type: ignore[union-attr]
                    ch.start += 1
                    ch.length -= 1
                    children[seqs[ch.seq][ch.start]] = ch  # type: ignore[index]
            elif ch.length == 1:
                ch.count += 1
                ch.seq = seq_id
                ch.start = pos
                b = node.best
                if b is not ch and (
                    ch.count > b.count or (ch.count == b.count and token < seqs[b.seq][b.start])  # type: ignore[union-attr]
                ):
                    node.best = ch
                act[i] = ch
            else:
                # Split `ch` after its first token; our suffix ends at the first part.
                head = Node(ch.count + 1, node, seq_id, pos, 1)
                ch.start += 1
                ch.length -= 1
                ch.parent = head
                head.children = {seqs[ch.seq][ch.start]: ch}
                head.best = ch
                children[token] = head  # type: ignore[index]
                b = node.best
                if b is ch or head.count > b.count or (  # type: ignore[union-attr]
                    head.count == b.count and token < seqs[b.seq][b.start]  # type: ignore[union-attr]
                ):
                    node.best = head
                act[i] = head

    def close(self, seq_id: int) -> None:
        """Seal a finished sequence: drop its active nodes (it can no longer grow)."""
        self._active.pop(seq_id, None)

    # --- removing ---------------------------------------------------------------------
    def remove(self, seq_id: int) -> None:
        """Delete a whole sequence: decrement its suffixes' counts, prune empty nodes.

        Nodes keep a reference into the most recent sequence that reached them,
        so with FIFO removal no surviving node points into the removed one.  Out
        of order, such nodes are re-pointed at an occurrence below them, or as a
        last resort found by scanning the remaining sequences.
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"no sequence {seq_id} in this suffix tree")
        self._active.pop(seq_id, None)
        root = self._root
        depth = self.max_depth
        n = len(seq)
        stale: list[Node] = []
        ends: list[Node] = []
        touched: dict[int, Node] = {}
        for start in range(n):
            stop = min(n, start + depth)
            root.count -= 1
            node, i, last_alive = root, start, root
            while i < stop:
                tok = seq[i]
                child = node.children[tok]  # type: ignore[index]
                child.count -= 1
                if node.count > 0 or node is root:
                    touched[id(node)] = node
                    if child.count == 0:
                        del node.children[tok]  # type: ignore[union-attr]
                    else:
                        last_alive = child
                        if child.seq == seq_id:
                            stale.append(child)
                i += child.length
                node = child
            ends.append(last_alive)
        self._num_tokens -= n
        self.version += 1
        for node in stale:
            if node.count > 0 and node.seq == seq_id:
                repoint(node, seq_id, seq, self._seqs)
        del self._seqs[seq_id]
        for node in touched.values():
            if node.count > 0 or node is root:
                if node.children:
                    node.best = best_child(node.children)
                else:
                    node.children = None if node is not root else {}
                    node.best = None
        for node in ends:
            if node is not root and node.count > 0 and node.children and len(node.children) == 1:
                ch = node.best
                if ch.count == node.count:  # type: ignore[union-attr]
                    self._merge_into_child(node, ch)  # type: ignore[arg-type]

    def _merge_into_child(self, node: Node, ch: Node) -> None:
        """Fuse ``node`` into its only child ``ch`` of equal count (compression); ``node`` dies."""
        parent = node.parent
        key = self._seqs[node.seq][node.start]
        ch.start -= node.length  # ch's sequence holds its whole root path
        ch.length += node.length
        ch.parent = parent
        parent.children[key] = ch  # type: ignore[union-attr]
        if parent.best is node:  # type: ignore[union-attr]
            parent.best = ch  # type: ignore[union-attr]
        node.count = 0  # dead

    # --- queries ----------------------------------------------------------------------
    def _walk(self, pattern: Sequence[int]) -> State | None:
        """Where ``pattern`` ends in the tree, or None if it does not occur."""
        seqs = self._seqs
        node, idx = self._root, 0
        for t in pattern:
            if idx < node.length:
                if seqs[node.seq][node.start + idx] != t:
                    return None
                idx += 1
            else:
                ch = node.children.get(t) if node.children else None
                if ch is None:
                    return None
                node, idx = ch, 1
        return node, idx

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of ``pattern`` (1..max_depth tokens) over all sequences."""
        if not pattern:
            return self._root.count
        st = self._walk(pattern)
        return 0 if st is None else st[0].count

    def next_counts(self, pattern: Sequence[int]) -> dict[int, int]:
        """For each token t, the occurrences of ``pattern + [t]``."""
        st = self._walk(pattern)
        if st is None:
            return {}
        node, idx = st
        if idx < node.length:
            return {self._seqs[node.seq][node.start + idx]: node.count}
        return {t: ch.count for t, ch in (node.children or {}).items()}

    def match_states(self, context: Sequence[int]) -> list[State]:
        """``states[m-1]`` is where ``context[-m:]`` ends, for m = 1..M (the longest match).

        If ``context[-m:]`` occurs so does every shorter suffix, so the matches
        are exactly m = 1..M.  O(M^2); use a ``SuffixMatcher`` to stream.
        """
        states: list[State] = []
        n = len(context)
        for m in range(1, min(n, self.max_depth) + 1):
            st = self._walk(context[n - m :])
            if st is None:
                break
            states.append(st)
        return states

    def active_states(self, seq_id: int) -> list[State]:
        """Match states of sequence ``seq_id``'s own end (it occurs in the tree, so m = 1..)."""
        return [(node, node.length) for node in self._active.get(seq_id, ())]

    # --- inspection -------------------------------------------------------------------
    def structure(self) -> dict[tuple[int, ...], int]:
        """Every node's root path -> count: equal structures mean equal trees."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[Node, tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, path = stack.pop()
            out[path] = node.count
            for ch in (node.children or {}).values():
                stack.append((ch, path + tuple(self._seqs[ch.seq][ch.start : ch.start + ch.length])))
        return out

    def check_integrity(self) -> list[str]:
        """Problems with the invariants documented on ``Node`` (empty when sound)."""
        bad: list[str] = []
        stack: list[tuple[Node, tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, path = stack.pop()
            kids = node.children or {}
            total = sum(ch.count for ch in kids.values())
            if total > node.count:
                bad.append(f"{path}: children count {total} > {node.count}")
            if node is not self._root:
                if node.count <= 0 or node.length <= 0:
                    bad.append(f"{path}: count {node.count}, length {node.length}")
                s = self._seqs.get(node.seq)
                end = node.start + node.length
                if s is None or end > len(s) or tuple(s[end - len(path) : end]) != path:
                    bad.append(f"{path}: reference ({node.seq}, {node.start}) does not hold the path")
                if len(kids) == 1 and total == node.count:
                    bad.append(f"{path}: single child with equal count (not compressed)")
            if kids and node.best is not best_child(kids):
                bad.append(f"{path}: best child is not the most frequent, smallest-token child")
            for t, ch in kids.items():
                if ch.parent is not node:
                    bad.append(f"{path}+{t}: wrong parent")
                label = tuple(self._seqs[ch.seq][ch.start : ch.start + ch.length]) if ch.seq in self._seqs else ()
                if not label or label[0] != t:
                    bad.append(f"{path}+{t}: label {label} does not start with its key")
                stack.append((ch, path + label))
        return bad

    # --- persistence (the file format: suffix_tree_file) -------------------------------
    def save(self, path: str | Path, vocab: suffix_tree_file.Vocab = suffix_tree_file.Vocab()) -> None:
        """Write the sequences (in order, open or closed) and ``vocab`` to an ``.npz``; ``load`` replays them."""
        suffix_tree_file.write(path, self.max_depth,
                               [(sid, seq, sid in self._active) for sid, seq in self._seqs.items()], vocab)

    @classmethod
    def load(cls, path: str | Path, max_depth: int | None = None,
             vocab: suffix_tree_file.Vocab = suffix_tree_file.Vocab()) -> "SuffixTree":
        """Rebuild a tree saved by ``save`` (optionally with another ``max_depth``).

        Anything that is not such a file raises SpecstackError naming the file;
        a file saved for another vocabulary than ``vocab`` raises VocabMismatchError.
        """
        depth, sequences = suffix_tree_file.read(path, vocab)
        tree = cls(depth if max_depth is None else max_depth)
        for sid, tokens, is_open in sequences:
            tree.extend(sid, tokens)
            tree._seqs.setdefault(sid, array("i"))  # an empty sequence still exists
            tree._active.setdefault(sid, [])
            if not is_open:
                tree.close(sid)
        return tree
