"""A suffix tree with occurrence counts over token sequences, for SuffixDecoding.

SuffixDecoding (Oliaro et al., arXiv 2411.04975), shaped like ArcticInference's
``suffix_tree.cc``: a path-compressed trie of every suffix of one or more
sequences, each cut at ``max_depth`` tokens.  A node's ``count`` is the number of
suffixes passing through it, which is the number of occurrences of the node's
path, so ``child.count / node.count`` estimates P(next token | matched text).

Appending a token costs O(max_depth): each sequence keeps its *active* nodes
(where its suffixes of length 1..max_depth currently end) and extends each by
the new token.  Nothing is rebuilt per step.
"""

from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from . import suffix_tree_file

__all__ = ["SuffixDraft", "SuffixTree", "SuffixMatcher"]


@dataclass(frozen=True, slots=True)
class SuffixDraft:
    """A path or tree of draft tokens, as ArcticInference returns it.

    ``parents[i]`` is the index of token i's parent in ``token_ids`` (-1: it
    follows the context directly); ``probs[i]`` is the path probability of
    token i (the product of child.count / parent.count along the way);
    ``score = sum(probs)``, the expected number of accepted tokens if the
    counts were the truth; ``match_len`` is the length of the context suffix
    the draft continues.
    """

    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    score: float = 0.0
    match_len: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)


class _Node:
    """A tree node: its label is ``seqs[seq][start:start + length]``.

    Invariants: every token of a label has the same count (so every suffix
    ends exactly at a node end); ``count >= sum(child.count)`` and the
    difference is the number of suffixes ending here; a non-root node never has
    a single child with the same count (it would be merged: compression);
    ``seqs[seq]`` holds the node's whole root path, ending at
    ``start + length``; ``best`` is the child with the largest count, the
    smallest first token on ties (a rule, not an accident of history, so a
    rebuilt tree drafts exactly like the original).
    """

    __slots__ = ("count", "children", "parent", "seq", "start", "length", "best")

    def __init__(self, count: int, parent: "_Node | None", seq: int, start: int, length: int) -> None:
        self.count = count
        self.children: dict[int, _Node] | None = None  # None for leaves: saves a dict per leaf
        self.parent = parent
        self.seq = seq
        self.start = start
        self.length = length
        self.best: _Node | None = None


_State = tuple[_Node, int]  # (node, tokens of its label matched so far, 1..length)
_Grown = tuple[float, Callable[[], SuffixDraft]]  # a draft's score now, the draft itself on demand
_Grow = Callable[[_Node, int, int, float, int], _Grown]  # (node, idx, cap, min_prob, m) -> grown draft


class SuffixTree:
    """Counts every substring (up to ``max_depth`` tokens) of a set of token sequences.

    Example: after ``extend(0, [1, 2, 3, 1, 2, 4])``, ``count([1, 2]) == 2`` and
    ``next_counts([1, 2]) == {3: 1, 4: 1}``; ``propose([5, 1], 3)`` matches
    ``[1]`` (m=1, so at most 1 token with max_spec_factor=1) and drafts ``[2]``
    with probability 1.0.

    Sequences are identified by integer ids; several may be open at once (each
    keeps its own active nodes).  ``remove`` deletes a whole sequence; it is
    cheapest when sequences are removed in the order they were added (FIFO),
    which is how the suffix drafter evicts.
    """

    def __init__(self, max_depth: int = 64) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1 (got {max_depth})")
        self.max_depth = int(max_depth)
        self._root = _Node(0, None, -1, 0, 0)
        self._root.children = {}
        self._seqs: dict[int, array] = {}  # int32 token arrays: 4 bytes a token
        # _active[seq][i]: node where that sequence's suffix of length i+1 ends.
        self._active: dict[int, list[_Node]] = {}
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

    def n_nodes(self) -> int:
        """Nodes including the root (O(nodes): for reports, not the hot loop)."""
        n, stack = 0, [self._root]
        while stack:
            node = stack.pop()
            n += 1
            if node.children:
                stack.extend(node.children.values())
        return n

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
                new = _Node(1, node, seq_id, pos, 1)
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
                    parent = node.parent
                    key = seqs[node.seq][node.start]
                    ch.length = node.length + 1
                    ch.count += 1
                    ch.seq = seq_id
                    ch.start = pos + 1 - ch.length
                    ch.parent = parent
                    parent.children[key] = ch  # type: ignore[union-attr]
                    if parent.best is node:
                        parent.best = ch
                    node.count = 0  # dead
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
                head = _Node(ch.count + 1, node, seq_id, pos, 1)
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
        stale: list[_Node] = []
        ends: list[_Node] = []
        touched: dict[int, _Node] = {}
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
                self._repoint(node, seq_id, seq)
        del self._seqs[seq_id]
        for node in touched.values():
            if node.count > 0 or node is root:
                if node.children:
                    node.best = self._best_child(node.children)
                else:
                    node.children = None if node is not root else {}
                    node.best = None
        for node in ends:
            if node is not root and node.count > 0 and node.children and len(node.children) == 1:
                ch = node.best
                if ch.count == node.count:  # type: ignore[union-attr]
                    self._merge_into_child(node, ch)  # type: ignore[arg-type]

    def _best_child(self, children: dict[int, _Node]) -> _Node:
        key = max(children, key=lambda t: (children[t].count, -t))
        return children[key]

    def _merge_into_child(self, node: _Node, ch: _Node) -> None:
        parent = node.parent
        key = self._seqs[node.seq][node.start]
        ch.start -= node.length  # ch's sequence holds its whole root path
        ch.length += node.length
        ch.parent = parent
        parent.children[key] = ch  # type: ignore[union-attr]
        if parent.best is node:  # type: ignore[union-attr]
            parent.best = ch  # type: ignore[union-attr]
        node.count = 0

    def _depth(self, node: _Node) -> int:
        d = 0
        while node is not None:
            d += node.length
            node = node.parent  # type: ignore[assignment]
        return d

    def _repoint(self, node: _Node, dead: int, dead_seq: array) -> None:
        """Give ``node`` (and stale nodes down to a live reference) a reference outside ``dead``."""
        # Any node below with a live reference holds our whole path too.
        queue, found = [node], None
        while queue and found is None:
            nxt = []
            for x in queue:
                if x.seq != dead:
                    found = x
                    break
                if x.children:
                    nxt.extend(x.children.values())
            queue = nxt
        if found is not None:
            # Walk up from `found` to `node`, fixing stale references on the way.
            d = self._depth(found)
            path_start = found.start + found.length - d
            x = found
            while x is not node:
                d -= x.length
                x = x.parent  # type: ignore[assignment]
                if x.seq == dead:
                    x.seq = found.seq
                    x.start = path_start + d - x.length
            return
        # Last resort: find the path in a remaining sequence.
        d = self._depth(node)
        end = node.start + node.length
        path = dead_seq[end - d : end]
        for sid, s in self._seqs.items():
            if sid == dead:
                continue
            at = _find(s, path)
            if at >= 0:
                node.seq = sid
                node.start = at + d - node.length
                return
        raise AssertionError("suffix tree: live node with no occurrence left")  # pragma: no cover

    # --- queries ----------------------------------------------------------------------
    def _walk(self, pattern: Sequence[int]) -> _State | None:
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

    def match_states(self, context: Sequence[int]) -> list[_State]:
        """``states[m-1]`` is where ``context[-m:]`` ends, for m = 1..M (the longest match).

        If ``context[-m:]`` occurs so does every shorter suffix, so the matches
        are exactly m = 1..M.  O(M^2); use a ``SuffixMatcher`` to stream.
        """
        states: list[_State] = []
        n = len(context)
        for m in range(1, min(n, self.max_depth) + 1):
            st = self._walk(context[n - m :])
            if st is None:
                break
            states.append(st)
        return states

    def active_states(self, seq_id: int) -> list[_State]:
        """Match states of sequence ``seq_id``'s own end (it occurs in the tree, so m = 1..)."""
        return [(node, node.length) for node in self._active.get(seq_id, ())]

    def propose(
        self,
        context: Sequence[int] | list[_State],
        max_tokens: int,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
    ) -> SuffixDraft:
        """Best greedy path over every match length m (ArcticInference calls this ``speculate``).

        For each m the draft follows the most frequent child, at most
        ``min(max_tokens, floor(max_spec_factor * m + max_spec_offset))`` tokens,
        stopping when the path probability drops below ``min_token_prob``;
        the highest score wins, the longer match on ties.  ``context`` is a token
        list or precomputed states (``match_states``/``active_states``/a matcher).
        """
        return self._best_draft(self._path, context, max_tokens, max_spec_factor, max_spec_offset, min_token_prob)

    def propose_tree(
        self,
        context: Sequence[int] | list[_State],
        max_tokens: int,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
    ) -> SuffixDraft:
        """Like ``propose`` but each m grows a best-first tree of up to the cap in tokens.

        Nodes are taken in order of path probability (a priority queue), so the
        tree holds the most likely continuations within the token budget.
        """
        return self._best_draft(self._tree, context, max_tokens, max_spec_factor, max_spec_offset, min_token_prob)

    def _best_draft(self, grow: _Grow, context: Sequence[int] | list[_State], max_tokens: int,
                    factor: float, offset: float, min_prob: float) -> SuffixDraft:
        """The best-scoring of ``grow``'s drafts over every match length m, the longest match on ties.

        Caps shrink with m and a draft never scores above its cap, so the search
        stops at the first m whose cap cannot beat the best score so far.
        """
        states = self._states(context)
        best_score, best = 0.0, SuffixDraft
        for m in range(len(states), 0, -1):
            cap = _cap(m, max_tokens, factor, offset)
            if cap <= best_score:
                break
            node, idx = states[m - 1]
            score, draft = grow(node, idx, cap, min_prob, m)
            if score > best_score:
                best_score, best = score, draft
        return best()

    def _states(self, context: Sequence[int] | list[_State]) -> list[_State]:
        if context and isinstance(context[0], tuple):
            return context  # type: ignore[return-value]
        return self.match_states(context)  # type: ignore[arg-type]

    def _path(self, node: _Node, idx: int, cap: int, min_prob: float, m: int) -> _Grown:
        """The greedy path from a match state: the most frequent child at every node.

        It is scored as it is walked, one step per node; its tokens are read
        only if it wins (``_chain``), which keeps trying every m cheap.
        """
        segments: list[tuple[_Node, int, int, float]] = []  # (node, label offset, tokens taken, path probability)
        n, p, score = 0, 1.0, 0.0
        while True:
            rest = node.length - idx
            if rest > 0:
                take = rest if rest < cap - n else cap - n
                segments.append((node, idx, take, p))
                n += take
                score += p * take
                if n >= cap:
                    break
            b = node.best
            if b is None:
                break
            p = p * b.count / node.count
            if p < min_prob:
                break
            node, idx = b, 0
        return score, lambda: self._chain(segments, score, m)

    def _chain(self, segments: list[tuple[_Node, int, int, float]], score: float, m: int) -> SuffixDraft:
        seqs = self._seqs
        toks: list[int] = []
        probs: list[float] = []
        for node, idx, take, p in segments:
            s = node.start + idx
            toks.extend(seqs[node.seq][s : s + take])
            probs.extend([p] * take)
        return SuffixDraft(tuple(toks), tuple(range(-1, len(toks) - 1)), tuple(probs), score, m)

    def _tree(self, node: _Node, idx: int, cap: int, min_prob: float, m: int) -> _Grown:
        """The best-first tree from a match state (its score needs the whole tree, so it is built now)."""
        seqs = self._seqs
        toks: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        tie = 0  # heap tie-breaker: first pushed first
        heap: list[tuple[float, int, _Node, int, int]] = [(-1.0, tie, node, idx, -1)]
        while heap and len(toks) < cap:
            neg_p, _, node, idx, parent = heapq.heappop(heap)
            if idx < node.length:
                toks.append(seqs[node.seq][node.start + idx])
                parents.append(parent)
                probs.append(-neg_p)
                tie += 1
                heapq.heappush(heap, (neg_p, tie, node, idx + 1, len(toks) - 1))
            elif node.children:
                for ch in node.children.values():
                    p = -neg_p * ch.count / node.count
                    if p >= min_prob:
                        tie += 1
                        heapq.heappush(heap, (-p, tie, ch, 0, parent))
        draft = SuffixDraft(tuple(toks), tuple(parents), tuple(probs), sum(probs), m)
        return draft.score, lambda: draft

    # --- inspection -------------------------------------------------------------------
    def structure(self) -> dict[tuple[int, ...], int]:
        """Every node's root path -> count: equal structures mean equal trees."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, path = stack.pop()
            out[path] = node.count
            for ch in (node.children or {}).values():
                stack.append((ch, path + tuple(self._seqs[ch.seq][ch.start : ch.start + ch.length])))
        return out

    def check_integrity(self) -> list[str]:
        """Problems with the invariants documented on ``_Node`` (empty when sound)."""
        bad: list[str] = []
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self._root, ())]
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
            if kids and node.best is not self._best_child(kids):
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


class SuffixMatcher:
    """Streams a context and keeps its match states in a tree that changes rarely.

    Each pushed token advances every state by one token (O(M)), so a drafter
    matching against a global tree pays O(max_depth) per token instead of
    O(max_depth^2) per proposal.  If the tree changes, states are recomputed
    from the last ``max_depth`` tokens.
    """

    def __init__(self, tree: SuffixTree, context: Sequence[int] = ()) -> None:
        self.tree = tree
        self._recent: list[int] = []
        self._states: list[_State] = []
        self._version = -1
        self.reset(context)

    def reset(self, context: Sequence[int]) -> None:
        self._recent = [int(t) for t in context[-self.tree.max_depth :]]
        self._resync()

    def extend(self, token_ids: Iterable[int]) -> None:
        depth = self.tree.max_depth
        for t in token_ids:
            t = int(t)
            self._recent.append(t)
            if self._version == self.tree.version:
                self._states = self._advance(self._states, t)
        if len(self._recent) > 2 * depth:
            del self._recent[:-depth]

    def states(self) -> list[_State]:
        if self._version != self.tree.version:
            self._resync()
        return self._states

    def _resync(self) -> None:
        states: list[_State] = []
        for t in self._recent[-self.tree.max_depth :]:
            states = self._advance(states, t)
        self._states = states
        self._version = self.tree.version

    def _advance(self, states: list[_State], t: int) -> list[_State]:
        seqs = self.tree._seqs
        out: list[_State] = []
        for node, idx in [(self.tree._root, 0), *states]:
            if idx < node.length:
                if seqs[node.seq][node.start + idx] != t:
                    break
                out.append((node, idx + 1))
            else:
                ch = node.children.get(t) if node.children else None
                if ch is None:
                    break  # longer suffixes cannot match either
                out.append((ch, 1))
        return out  # no node is deeper than max_depth, so neither is any state


def _cap(m: int, max_tokens: int, factor: float, offset: float) -> int:
    return max(0, min(max_tokens, int(m * factor + offset + 1e-6)))


def _find(seq: array, pattern: array) -> int:
    """First index where ``pattern`` occurs in ``seq``, or -1 (plain scan)."""
    n, first = len(pattern), pattern[0]
    i = -1
    try:
        while True:
            i = seq.index(first, i + 1)
            if seq[i : i + n] == pattern:
                return i
    except ValueError:
        return -1
