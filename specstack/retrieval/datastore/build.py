"""Building a REST datastore: the suffix array, the store folder, and ingesting a corpus of files.

``build_from_files`` is what ``specstack datastore build`` runs: collect the
text files, tokenize them, and write the store (skipped when its inputs have
not changed).  ``write_store`` writes a store from token sequences directly.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from ...errors import SpecstackError
from ...ui import Progress
from .store import FORMAT, FORMAT_VERSION, SENTINEL, SORT_DEPTH, Datastore

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
    try:
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
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SpecstackError(f"cannot write the datastore to {out}: {exc.strerror or exc}; choose a folder you can "
                             "write (-o)") from None
    return meta


def _check_writable(folder: Path) -> None:
    """Probe by writing (root passes permission checks that the filesystem still refuses), before the slow part."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".specstack-probe-"):
            pass
    except OSError as exc:
        raise SpecstackError(f"cannot write the datastore in {folder}: {exc.strerror or exc}; choose a folder you "
                             "can write (-o)") from None


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


# --- ingesting a corpus -------------------------------------------------------------------
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
    quiet: bool = False,
) -> BuildResult:
    """Tokenize the text files of ``corpus`` and write a store to ``out``.

    ``tokenizer`` must hold a ``fingerprint`` of the vocabulary.  The inputs
    (tokenizer, every file's name, size and sha256, the options) are digested;
    if ``out`` already holds a store with the same digest nothing is done.
    Tokenizing shows a ``ui.Progress`` unless ``quiet``; other messages go to ``log`` (stderr).
    """
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    out = Path(out)
    _check_replaceable(out)  # fail before the slow part
    _check_writable(out.parent)
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
    progress = Progress("tokenizing", len(files), "files", quiet=quiet)
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
        progress.update(i, f"{total} tokens")
    progress.close(f"tokenized {len(docs)} files, {total} tokens")
    if skipped:
        log(f"skipped {skipped} binary or non-UTF-8 files")
    if total == 0:
        raise SpecstackError(f"nothing to index: the {len(files)} file(s) given hold no UTF-8 text tokens ({skipped} "
                             "binary or non-UTF-8); point the corpus at source or text files")
    log(f"sorting {total} suffixes")
    meta = write_store(out, docs, n_vocab=n_vocab, tokenizer=tokenizer, sources=used, inputs_digest=digest)
    return BuildResult(out, False, meta, time.perf_counter() - t0)
