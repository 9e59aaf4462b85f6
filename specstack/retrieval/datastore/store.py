"""The query side of a REST datastore: open a built store (memory-mapped) and look drafts up (``propose``, ``propose_tree``).

The store's format (see the package docstring) is defined here; ``build``
writes it.  Every problem with a store on disk becomes a SpecstackError that
names the folder and how to rebuild it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

from ...errors import SpecstackError
from ..lookup import Lookup

FORMAT = "specstack-datastore"
FORMAT_VERSION = 1
SORT_DEPTH = 64
SENTINEL = -1
_FILES = ("tokens.npy", "sa.npy", "index.npy", "meta.json")


class Datastore:
    """A built store, memory-mapped: open once, propose per step.

    Example: a store of the single document ``[5, 6, 7, 5, 6, 8]``; for the
    context ``[1, 5, 6]`` the longest match is ``[5, 6]`` (m=2, 2 occurrences),
    followed by 7 once and 8 once, so ``propose(..., k=2)`` gives ``[7, 5]``
    (the tie goes to the smaller id) with probabilities 1/2, 1/2.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        fix = f"rebuild it with `specstack datastore build CORPUS -o {self.path}`"
        if not self.path.is_dir():
            raise SpecstackError(
                f"datastore {self.path} does not exist; build one with "
                f"`specstack datastore build CORPUS -o {self.path}`"
            )
        missing = [f for f in _FILES if not (self.path / f).is_file()]
        if missing:
            raise SpecstackError(f"datastore {self.path} is incomplete (missing {', '.join(missing)}); {fix}")
        try:
            self.meta = json.loads((self.path / "meta.json").read_text())
        except (OSError, ValueError) as exc:
            raise SpecstackError(f"datastore {self.path}: meta.json is unreadable ({exc}); {fix}") from None
        if not isinstance(self.meta, dict) or self.meta.get("format") != FORMAT:
            raise SpecstackError(f"{self.path} is not a specstack datastore (meta.json format); {fix}")
        if self.meta.get("version") != FORMAT_VERSION:
            raise SpecstackError(
                f"datastore {self.path} has format version {self.meta.get('version')}, this "
                f"specstack reads version {FORMAT_VERSION}; {fix}"
            )
        self.tokens, self.sa, self.index = (_load(self.path, name, fix) for name in _FILES[:3])
        try:
            n_tokens, n_docs, n_vocab = (int(self.meta[k]) for k in ("n_tokens", "n_docs", "n_vocab"))
            self.sort_depth = int(self.meta["sort_depth"])
        except (ValueError, KeyError, TypeError) as exc:
            raise SpecstackError(f"datastore {self.path} is corrupt (meta.json: {exc}); {fix}") from None
        ok = (
            self.tokens.dtype == np.int32
            and self.tokens.ndim == 1
            and len(self.tokens) == n_tokens + n_docs
            and (n_docs == 0 or self.tokens[-1] == SENTINEL)
            and self.sa.dtype in (np.int32, np.int64)
            and self.sa.shape == (n_tokens,)
            and self.index.dtype == np.int64
            and self.index.shape == (n_vocab + 1,)
            and (n_vocab == 0 or (self.index[0] == 0 and self.index[-1] == n_tokens))
        )
        if not ok:
            raise SpecstackError(f"datastore {self.path} is corrupt (array sizes disagree with meta.json); {fix}")
        problem = _content_problem(self.tokens, self.sa, self.index, n_vocab)
        if problem:
            raise SpecstackError(f"datastore {self.path} is corrupt ({problem}); {fix}")
        self.n_tokens, self.n_docs, self.n_vocab = n_tokens, n_docs, n_vocab
        self._n = len(self.tokens)
        # Plain ndarray views of the same mapped memory: slicing a np.memmap
        # costs microseconds of subclass bookkeeping, in the innermost loop.
        self._tok = self.tokens.view(np.ndarray)
        self._sa = self.sa.view(np.ndarray)
        self._index = self.index.view(np.ndarray)

    @property
    def fingerprint(self) -> str | None:
        return (self.meta.get("tokenizer") or {}).get("fingerprint")

    def find(self, pattern: Sequence[int]) -> tuple[int, int]:
        """``sa[lo:hi]`` are the occurrences of ``pattern`` (1..sort_depth tokens)."""
        m = len(pattern)
        t0 = int(pattern[0])
        if not 0 <= t0 < self.n_vocab or m > self.sort_depth:
            return 0, 0
        lo, hi = int(self._index[t0]), int(self._index[t0 + 1])
        if m == 1 or lo == hi:
            return lo, hi
        want = [int(t) for t in pattern[1:]]
        sa, tok = self._sa, self._tok
        # Lower bound: first suffix whose tokens 1..m-1 are >= want.
        a, b = lo, hi
        while a < b:
            mid = (a + b) // 2
            p = int(sa[mid])
            if tok[p + 1 : p + m].tolist() < want:
                a = mid + 1
            else:
                b = mid
        start = a
        # Upper bound by galloping from the lower bound: matches are usually few.
        step, b = 1, start
        while b < hi:
            p = int(sa[b])
            if tok[p + 1 : p + m].tolist() != want:
                break
            a, b = b + 1, min(hi, b + step)
            step *= 2
        while a < b:  # first suffix in [a, b) whose window differs (is greater)
            mid = (a + b) // 2
            p = int(sa[mid])
            if tok[p + 1 : p + m].tolist() == want:
                a = mid + 1
            else:
                b = mid
        return start, a

    def longest_match(self, context: Sequence[int], max_match: int = 16, min_match: int = 1) -> tuple[int, int, int]:
        """(m, lo, hi) for the longest suffix of ``context`` (min_match..max_match tokens) in the store.

        Occurrence is monotone in m (a suffix of an occurring pattern occurs),
        so m is found by binary search: O(log max_match) pattern searches.
        m = 0 when not even ``min_match`` tokens match.
        """
        top = min(max_match, len(context), self.sort_depth)
        best = (0, 0, 0)
        a, b = min_match, top
        while a <= b:
            m = (a + b) // 2
            lo, hi = self.find(context[len(context) - m :])
            if hi > lo:
                best = (m, lo, hi)
                a = m + 1
            else:
                b = m - 1
        return best

    def continuations(self, lo: int, hi: int, m: int, k: int, max_candidates: int = 1024) -> np.ndarray:
        """Next ``k`` tokens after each (sampled) occurrence in ``sa[lo:hi]``; -1 past a document end.

        More than ``max_candidates`` occurrences are sampled at an even stride:
        they are sorted by what follows, so a stride sample keeps the mix.
        """
        count = hi - lo
        if count > max_candidates:
            pick = lo + (np.arange(max_candidates, dtype=np.int64) * count) // max_candidates
            pos = self._sa[pick].astype(np.int64)
        else:
            pos = self._sa[lo:hi].astype(np.int64)
        idx = np.minimum(pos[:, None] + m + np.arange(k), self._n - 1)  # [n, k]; the last token is a sentinel
        rows = self._tok[idx]
        dead = np.maximum.accumulate(rows == SENTINEL, axis=1)
        rows[dead] = SENTINEL
        return rows

    def propose(
        self,
        context: Sequence[int],
        k: int,
        max_match: int = 16,
        min_match: int = 1,
        max_candidates: int = 1024,
        min_token_prob: float = 0.0,
    ) -> Lookup:
        """The most frequent continuation of the longest matching suffix, as a chain.

        Token j is the most frequent next token among occurrences that agree
        with tokens 0..j-1 (smallest id on ties); stops at ``k`` tokens, at a
        dead end, or when the fraction of occurrences agreeing drops below
        ``min_token_prob``.
        """
        if k <= 0 or not context:
            return Lookup()
        m, lo, hi = self.longest_match(context, max_match, min_match)
        if m == 0:
            return Lookup()
        rows = _sorted_rows(self.continuations(lo, hi, m, k, max_candidates))  # [n, k]
        total = len(rows)
        toks: list[int] = []
        probs: list[float] = []
        a, b = 0, total  # rows[a:b] agree with the draft so far (sorted rows: a contiguous run)
        for j in range(k):
            v = rows[a:b, j]
            cut = np.flatnonzero(v[1:] != v[:-1]) + 1
            starts = np.concatenate(([0], cut))
            ends = np.concatenate((cut, [len(v)]))
            if v[0] == SENTINEL:  # occurrences whose document ended: no vote
                starts, ends = starts[1:], ends[1:]
            if len(starts) == 0:
                break
            i = int(np.argmax(ends - starts))  # first maximum: the smallest id
            p = float(ends[i] - starts[i]) / total
            if p < min_token_prob:
                break
            toks.append(int(v[starts[i]]))
            probs.append(p)
            a, b = a + int(starts[i]), a + int(ends[i])
        n = len(toks)
        return Lookup(tuple(toks), tuple(range(-1, n - 1)), tuple(probs), m, n_matches=hi - lo, n_sampled=total)

    def propose_tree(
        self,
        context: Sequence[int],
        k: int,
        budget: int,
        max_match: int = 16,
        min_match: int = 1,
        max_candidates: int = 1024,
        min_token_prob: float = 0.0,
    ) -> Lookup:
        """The ``budget`` most frequent continuation prefixes (up to ``k`` deep), as a tree.

        REST's trie of candidates: every distinct prefix of a sampled
        continuation is a node weighted by how many occurrences share it; the
        heaviest nodes are kept (shallower first on ties, so a node's parent is
        always kept before it).  Token order puts parents before children.
        """
        if k <= 0 or budget <= 0 or not context:
            return Lookup()
        m, lo, hi = self.longest_match(context, max_match, min_match)
        if m == 0:
            return Lookup()
        rows = _sorted_rows(self.continuations(lo, hi, m, k, max_candidates))  # [n, k]
        n, k = rows.shape
        # new[i, j]: row i starts a new group of equal prefixes rows[:, :j+1].
        new = np.ones((n, k), dtype=bool)
        new[1:] = np.logical_or.accumulate(rows[1:] != rows[:-1], axis=1)
        starts, depth, count, parent = [], [], [], []  # one entry per trie node
        prev_starts, prev_ids = np.zeros(1, dtype=np.int64), np.array([-1])
        for j in range(k):
            s = np.flatnonzero(new[:, j])
            c = np.diff(np.append(s, n))
            live = rows[s, j] != SENTINEL
            s, c = s[live], c[live]
            if len(s) == 0:
                break
            first = sum(map(len, starts))
            ids = first + np.arange(len(s))
            par = prev_ids[np.searchsorted(prev_starts, s, side="right") - 1] if j else np.full(len(s), -1)
            starts.append(s)
            depth.append(np.full(len(s), j))
            count.append(c)
            parent.append(par)
            prev_starts, prev_ids = s, ids
        if not starts:
            return Lookup(match_len=m, n_matches=hi - lo, n_sampled=n)
        s, d, c, par = (np.concatenate(x) for x in (starts, depth, count, parent))
        order = np.lexsort((s, d, -c))  # heaviest first; shallower, then smaller prefix, on ties
        order = order[c[order] / n >= min_token_prob][:budget]
        where = np.full(len(s) + 1, -1)  # node id -> output index; where[-1] = -1 for roots
        where[order] = np.arange(len(order))
        toks = tuple(int(rows[s[i], d[i]]) for i in order)
        parents = tuple(int(where[par[i]]) for i in order)
        probs = tuple(float(c[i]) / n for i in order)
        return Lookup(toks, parents, probs, m, n_matches=hi - lo, n_sampled=n)


SAMPLE = 4096  # suffix-array entries whose bucket is checked at open (``_content_problem``)


def _load(folder: Path, name: str, fix: str) -> np.ndarray:
    """One array of a store, memory-mapped; any damage is a SpecstackError naming the file and ``fix``."""
    try:
        return np.load(folder / name, mmap_mode="r")
    except EOFError:  # a zero-byte file: numpy says only "No data left in file"
        problem = "it is empty"
    except (OSError, ValueError) as exc:
        problem = str(exc)
    raise SpecstackError(f"datastore {folder} is corrupt ({name}: {problem}); {fix}")


def _content_problem(tokens: np.ndarray, sa: np.ndarray, index: np.ndarray, n_vocab: int) -> str | None:
    """What is wrong inside arrays whose sizes agree with meta.json, or None.

    Why at open: a suffix-array entry outside the token array, or a token id outside the vocabulary, does not
    fail a lookup; it reads another position (numpy wraps negative indices) or hands the target an id it cannot
    decode, so a damaged store silently drafts nothing, or garbage.  The range checks read every entry (one
    sequential pass over the mapped files, fast next to loading a model); whether entries sit in the bucket of
    their first token is checked on an even sample of ``SAMPLE`` entries, which catches any wholesale damage.
    """
    if len(tokens) and (int(tokens.min()) < SENTINEL or int(tokens.max()) >= n_vocab):
        return f"tokens.npy holds ids outside the vocabulary 0..{n_vocab - 1}"
    if len(index) > 1 and bool(np.any(np.diff(index) < 0)):
        return "index.npy is not in increasing order"
    if len(sa) == 0:
        return None
    if int(sa.min()) < 0 or int(sa.max()) >= len(tokens) - 1:
        return f"sa.npy holds positions outside the {len(tokens)} tokens of tokens.npy"
    picks = np.unique(np.linspace(0, len(sa) - 1, min(SAMPLE, len(sa))).astype(np.int64))
    bucket = np.searchsorted(index, picks, side="right") - 1  # the first token of the suffixes sa[pick] points at
    if not np.array_equal(np.asarray(tokens)[np.asarray(sa)[picks]], bucket):
        return "sa.npy does not match tokens.npy and index.npy (its entries are not sorted by their tokens)"
    return None


def _sorted_rows(rows: np.ndarray) -> np.ndarray:
    """Rows in lexicographic order (column 0 first): equal prefixes become contiguous runs."""
    if len(rows) <= 1:
        return rows
    return rows[np.lexsort(rows.T[::-1])]


