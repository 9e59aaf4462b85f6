"""A static token datastore for REST: a memory-mapped suffix array over a tokenized corpus.

REST (He et al., arXiv 2311.08252): find the longest suffix of the context
that occurs in a corpus, then draft the most frequent continuations of its
occurrences.  A store is a folder::

    tokens.npy  int32 [n_tokens + n_docs]  documents, each followed by SENTINEL (-1)
    sa.npy      int32/int64 [n_tokens]     start positions sorted by the tokens there
    index.npy   int64 [n_vocab + 1]        sa[index[t]:index[t+1]] start with token t
    meta.json   format version, tokenizer fingerprint, sources, sizes

Suffixes are sorted by their first ``sort_depth`` (64) tokens only, which keeps
the build to a few prefix-doubling rounds; searches for patterns up to that
length are exact, and ties beyond it keep position order.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from .errors import SpecstackError

__all__ = [
    "Datastore",
    "Retrieval",
    "BuildResult",
    "build_suffix_array",
    "write_store",
    "collect_files",
    "build_from_files",
    "SENTINEL",
]

FORMAT = "specstack-datastore"
FORMAT_VERSION = 1
SORT_DEPTH = 64
SENTINEL = -1
_FILES = ("tokens.npy", "sa.npy", "index.npy", "meta.json")


@dataclass(frozen=True, slots=True)
class Retrieval:
    """Draft tokens retrieved for one context: a chain, or a tree when ``parents`` branch.

    ``probs[i]`` is the fraction of the sampled occurrences of the matched
    suffix that continue with token i's whole path; ``match_len`` is the
    length of that suffix, ``num_matches`` its occurrences in the store and
    ``num_sampled`` how many of them were read.
    """

    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    match_len: int = 0
    num_matches: int = 0
    num_sampled: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)


# --- building ---------------------------------------------------------------------------
def build_suffix_array(tokens: np.ndarray, depth: int = SORT_DEPTH) -> np.ndarray:
    """Start positions of all non-sentinel tokens, sorted by their next ``depth`` tokens.

    Prefix doubling: after the round with step h the rank of a position orders
    its first 2h tokens, so log2(depth) stable sorts suffice (a depth that is
    not a power of two is rounded up); ties beyond that keep position order.  The sentinel
    sorts before every token and the end of the array before the sentinel.
    """
    tokens = np.asarray(tokens)
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    _, rank = np.unique(tokens, return_inverse=True)
    rank = rank.astype(np.int64).reshape(-1) + 1  # [n] 1.. by token value; 0 = past the end
    sa = np.argsort(rank, kind="stable")
    h = 1
    while h < depth and int(rank.max()) < n:
        nxt = np.zeros(n, dtype=np.int64)
        nxt[: n - h] = rank[h:]
        key = rank * (n + 1) + nxt  # ranks <= n, so this orders (rank, next rank) pairs
        sa = np.argsort(key, kind="stable")
        ks = key[sa]
        rank = np.empty(n, dtype=np.int64)
        rank[sa] = np.cumsum(np.concatenate(([1], ks[1:] != ks[:-1])))
        h *= 2
    sa = sa[tokens[sa] != SENTINEL]
    return sa.astype(np.int32 if n < 2**31 else np.int64)


def write_store(
    out: str | Path,
    docs: Iterable[Sequence[int] | np.ndarray],
    *,
    n_vocab: int,
    tokenizer: dict | None = None,
    sources: list[dict] | None = None,
    inputs_digest: str | None = None,
    sort_depth: int = SORT_DEPTH,
) -> dict:
    """Write a store for ``docs`` (token id sequences) to folder ``out``; returns its meta.

    The folder is built beside ``out`` and moved into place, so a crash never
    leaves half a store; an existing store at ``out`` is replaced.
    """
    out = Path(out)
    parts: list[np.ndarray] = []
    n_docs = 0
    for doc in docs:
        arr = np.asarray(doc, dtype=np.int64).reshape(-1)
        if len(arr) and (arr.min() < 0 or arr.max() >= n_vocab):
            raise SpecstackError(
                f"token ids must be in [0, {n_vocab}) for this vocabulary "
                f"(got {int(arr.min())}..{int(arr.max())})"
            )
        parts.append(arr.astype(np.int32))
        parts.append(np.array([SENTINEL], dtype=np.int32))
        n_docs += 1
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    sa = build_suffix_array(tokens, sort_depth)
    index = np.searchsorted(tokens[sa], np.arange(n_vocab + 1)).astype(np.int64)
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "n_tokens": int(len(sa)),
        "n_docs": n_docs,
        "n_vocab": int(n_vocab),
        "sort_depth": int(sort_depth),
        "tokenizer": tokenizer or {},
        "inputs_digest": inputs_digest,
        "sources": sources or [],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _check_replaceable(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    np.save(tmp / "tokens.npy", tokens)
    np.save(tmp / "sa.npy", sa)
    np.save(tmp / "index.npy", index)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return meta


def _check_replaceable(out: Path) -> None:
    """Only ever delete an empty folder or a store of ours."""
    if not out.exists():
        return
    if out.is_dir() and not any(out.iterdir()):
        return
    try:
        ok = out.is_dir() and json.loads((out / "meta.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise SpecstackError(
            f"{out} exists and is not a specstack datastore; choose another output folder (-o)"
        )


# --- reading ----------------------------------------------------------------------------
class Datastore:
    """A built store, memory-mapped: open once, retrieve per step.

    Example: a store of the single document ``[5, 6, 7, 5, 6, 8]``; for the
    context ``[1, 5, 6]`` the longest match is ``[5, 6]`` (m=2, 2 occurrences),
    followed by 7 once and 8 once, so ``retrieve(..., k=2)`` gives ``[7, 5]``
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
        try:
            self.tokens = np.load(self.path / "tokens.npy", mmap_mode="r")
            self.sa = np.load(self.path / "sa.npy", mmap_mode="r")
            self.index = np.load(self.path / "index.npy", mmap_mode="r")
            n_tokens, n_docs, n_vocab = (int(self.meta[k]) for k in ("n_tokens", "n_docs", "n_vocab"))
            self.sort_depth = int(self.meta["sort_depth"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SpecstackError(f"datastore {self.path} is corrupt ({exc}); {fix}") from None
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

    def retrieve(
        self,
        context: Sequence[int],
        k: int,
        max_match: int = 16,
        min_match: int = 1,
        max_candidates: int = 1024,
        min_token_prob: float = 0.0,
    ) -> Retrieval:
        """The most frequent continuation of the longest matching suffix, as a chain.

        Token j is the most frequent next token among occurrences that agree
        with tokens 0..j-1 (smallest id on ties); stops at ``k`` tokens, at a
        dead end, or when the fraction of occurrences agreeing drops below
        ``min_token_prob``.
        """
        if k <= 0 or not context:
            return Retrieval()
        m, lo, hi = self.longest_match(context, max_match, min_match)
        if m == 0:
            return Retrieval()
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
        return Retrieval(tuple(toks), tuple(range(-1, n - 1)), tuple(probs), m, hi - lo, total)

    def retrieve_tree(
        self,
        context: Sequence[int],
        k: int,
        budget: int,
        max_match: int = 16,
        min_match: int = 1,
        max_candidates: int = 1024,
        min_token_prob: float = 0.0,
    ) -> Retrieval:
        """The ``budget`` most frequent continuation prefixes (up to ``k`` deep), as a tree.

        REST's trie of candidates: every distinct prefix of a sampled
        continuation is a node weighted by how many occurrences share it; the
        heaviest nodes are kept (shallower first on ties, so a node's parent is
        always kept before it).  Token order puts parents before children.
        """
        if k <= 0 or budget <= 0 or not context:
            return Retrieval()
        m, lo, hi = self.longest_match(context, max_match, min_match)
        if m == 0:
            return Retrieval()
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
            return Retrieval((), (), (), m, hi - lo, n)
        s, d, c, par = (np.concatenate(x) for x in (starts, depth, count, parent))
        order = np.lexsort((s, d, -c))  # heaviest first; shallower, then smaller prefix, on ties
        order = order[c[order] / n >= min_token_prob][:budget]
        where = np.full(len(s) + 1, -1)  # node id -> output index; where[-1] = -1 for roots
        where[order] = np.arange(len(order))
        toks = tuple(int(rows[s[i], d[i]]) for i in order)
        parents = tuple(int(where[par[i]]) for i in order)
        probs = tuple(float(c[i]) / n for i in order)
        return Retrieval(toks, parents, probs, m, hi - lo, n)


def _sorted_rows(rows: np.ndarray) -> np.ndarray:
    """Rows in lexicographic order (column 0 first): equal prefixes become contiguous runs."""
    if len(rows) <= 1:
        return rows
    return rows[np.lexsort(rows.T[::-1])]


# --- building from files ------------------------------------------------------------------
@dataclass(frozen=True)
class BuildResult:
    """What ``build_from_files`` did: ``skipped`` when the store was already up to date."""

    path: Path
    skipped: bool
    meta: dict
    seconds: float


def is_text_file(path: Path, sniff: int = 8192) -> bool:
    """Text = no NUL byte in the first ``sniff`` bytes and valid UTF-8 throughout."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if b"\0" in data[:sniff]:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def collect_files(
    corpus: Sequence[str | Path],
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> list[tuple[Path, str]]:
    """Files to index, as (path, name) in a stable order.

    Folders are walked recursively (hidden folders and ``__pycache__``
    skipped); a file's name is its path relative to the folder given.
    ``include`` (file-name globs, e.g. ``*.py``) limits what folders
    contribute; ``exclude`` globs are matched against that relative name, so a
    list of relative paths (like ``held_out.txt``) excludes exactly those files.
    Files named directly are always taken (unless excluded).
    """
    out: list[tuple[Path, str]] = []
    seen: set[Path] = set()
    for root in map(Path, corpus):
        if not root.exists():
            raise SpecstackError(f"corpus path {root} does not exist")
        if root.is_file():
            found = [(root, root.name)]
        else:
            found = []
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
                for f in sorted(filenames):
                    if include and not any(fnmatch.fnmatch(f, g) for g in include):
                        continue
                    p = Path(dirpath) / f
                    found.append((p, p.relative_to(root).as_posix()))
        for p, name in found:
            if any(fnmatch.fnmatchcase(name, g) for g in exclude):
                continue
            rp = p.resolve()
            if rp not in seen and p.is_file():
                seen.add(rp)
                out.append((p, name))
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_from_files(
    corpus: Sequence[str | Path],
    out: str | Path,
    tokenize: Callable[[str], Sequence[int]],
    *,
    n_vocab: int,
    tokenizer: dict,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    max_tokens: int | None = None,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> BuildResult:
    """Tokenize the text files of ``corpus`` and write a store to ``out``.

    ``tokenizer`` must hold a ``fingerprint`` of the vocabulary.  The inputs
    (tokenizer, every file's name, size and sha256, the options) are digested;
    if ``out`` already holds a store with the same digest nothing is done.
    """
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    out = Path(out)
    _check_replaceable(out)  # fail before the slow part
    inside = out.resolve()
    files = [(p, n) for p, n in collect_files(corpus, include, exclude)
             if inside not in p.resolve().parents]  # never index a store built inside the corpus
    sources = []
    for p, name in files:
        st = p.stat()
        sources.append({"name": name, "path": str(p.resolve()), "size": st.st_size,
                        "mtime_ns": st.st_mtime_ns, "sha256": _sha256(p)})
    digest = hashlib.sha256(
        json.dumps(
            {
                "format": FORMAT_VERSION,
                "sort_depth": SORT_DEPTH,
                "tokenizer": tokenizer.get("fingerprint"),
                "n_vocab": n_vocab,
                "max_tokens": max_tokens,
                "files": [(s["path"], s["size"], s["sha256"]) for s in sources],
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()
    if not force and (out / "meta.json").is_file():
        try:
            old = json.loads((out / "meta.json").read_text())
        except (OSError, ValueError):
            old = {}
        if old.get("inputs_digest") == digest and old.get("version") == FORMAT_VERSION:
            try:
                Datastore(out)
            except SpecstackError:
                pass  # damaged: rebuild
            else:
                log(f"datastore {out} is up to date ({old.get('n_tokens')} tokens from "
                    f"{old.get('n_docs')} files); nothing to do (--force rebuilds)")
                return BuildResult(out, True, old, time.perf_counter() - t0)
    if not files:
        raise SpecstackError("no files to index: check the corpus paths and --include/--exclude patterns")
    docs: list[list[int]] = []
    used: list[dict] = []
    total, skipped = 0, 0
    step = max(1, len(files) // 20)
    for i, ((p, name), src) in enumerate(zip(files, sources), start=1):
        if not is_text_file(p):
            skipped += 1
            continue
        ids = list(tokenize(p.read_text(encoding="utf-8")))
        if max_tokens is not None and total + len(ids) > max_tokens:
            log(f"stopping at {total} tokens: the next file would pass --max-tokens {max_tokens}")
            break
        docs.append(ids)
        used.append({**src, "tokens": len(ids)})
        total += len(ids)
        if i % step == 0 or i == len(files):
            log(f"tokenized {i}/{len(files)} files, {total} tokens")
    if skipped:
        log(f"skipped {skipped} binary or non-UTF-8 files")
    log(f"sorting {total} suffixes")
    meta = write_store(out, docs, n_vocab=n_vocab, tokenizer=tokenizer, sources=used, inputs_digest=digest)
    return BuildResult(out, False, meta, time.perf_counter() - t0)
