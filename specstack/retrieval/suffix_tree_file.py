"""The suffix tree's file (``--suffix-cache``): its sequences in an ``.npz``, written atomically.

A tree is a function of its sequences (canonical compression and a fixed
tie rule), so the file stores tokens, not nodes: it stays small, saves fast,
and ``SuffixTree.load`` replays the sequences to rebuild the tree exactly.
The file also records the vocabulary its token ids belong to (the target's
GGUF vocabulary fingerprint and n_vocab): a cache built for another model is
refused on load, since its ids would mean other text.  Files written before
that field existed carry no vocabulary; they are still loaded, but refused if
any token id is outside the expected vocabulary.
This module knows the format only; ``SuffixTree.save``/``load`` use it.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import SpecstackError, VocabMismatchError

FORMAT = "specstack-suffix-tree"
FORMAT_VERSION = 1

Stored = tuple[int, Sequence[int], bool]  # (sequence id, its tokens, still open)


@dataclass(frozen=True, slots=True)
class Vocab:
    """The vocabulary token ids belong to: the GGUF ``vocab_fingerprint`` and/or ``n_vocab`` (None: unknown)."""

    fingerprint: str | None = None
    n_vocab: int | None = None


def _fix(path: Path) -> str:
    return f"delete {path} (it is only a cache) or point cache_path (--suffix-cache) at another file"


def write(path: str | Path, max_depth: int, sequences: Sequence[Stored], vocab: Vocab = Vocab()) -> None:
    """Write ``sequences`` (in order) to ``path`` through a temporary file: a crash never leaves half a file."""
    parts = [np.asarray(tokens, dtype=np.int32) for _, tokens, _ in sequences]
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez_compressed(
                f,
                format=np.array(FORMAT),
                version=np.array(FORMAT_VERSION),
                max_depth=np.array(max_depth),
                vocab_fingerprint=np.array(vocab.fingerprint or ""),
                n_vocab=np.array(-1 if vocab.n_vocab is None else vocab.n_vocab, dtype=np.int64),
                seq_ids=np.array([sid for sid, _, _ in sequences], dtype=np.int64),
                seq_lengths=np.array([len(p) for p in parts], dtype=np.int64),
                seq_open=np.array([is_open for _, _, is_open in sequences], dtype=np.bool_),
                tokens=np.concatenate(parts) if parts else np.zeros(0, np.int32),
            )
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # the previous file, if any, is untouched
        raise


def check_vocab(path: str | Path, stored: Vocab, expected: Vocab, max_token: int) -> None:
    """Refuse a file whose token ids belong to another vocabulary than ``expected``.

    The fingerprint decides when both sides have one, else n_vocab; a file
    without either (written before they were stored) is refused only if a
    token id cannot belong to the expected vocabulary.
    """
    path = Path(path)
    fix = _fix(path)
    if stored.fingerprint and expected.fingerprint:
        if stored.fingerprint != expected.fingerprint:
            raise VocabMismatchError(
                f"suffix tree cache {path} was built with another model's vocabulary (fingerprint "
                f"{stored.fingerprint[:12]}, the target's is {expected.fingerprint[:12]}); {fix}")
        return
    if expected.n_vocab is None:
        return
    if stored.n_vocab is not None and stored.n_vocab != expected.n_vocab:
        raise VocabMismatchError(
            f"suffix tree cache {path} was built for a vocabulary of {stored.n_vocab} tokens, the "
            f"target has {expected.n_vocab}; {fix}")
    if max_token >= expected.n_vocab:
        raise VocabMismatchError(
            f"suffix tree cache {path} holds token id {max_token}, outside the target's vocabulary "
            f"of {expected.n_vocab} tokens (it was built for another model); {fix}")


def read(path: str | Path, expected: Vocab = Vocab()) -> tuple[int, list[Stored]]:
    """(max_depth, sequences) from a file ``write`` made, for the ``expected`` vocabulary.

    Anything that is not such a file raises SpecstackError naming the file and
    the fix; a file for another vocabulary raises VocabMismatchError (``check_vocab``).
    """
    path = Path(path)
    fix = _fix(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            if "format" not in z.files or str(z["format"]) != FORMAT:
                raise SpecstackError(f"{path} is not a specstack suffix tree cache; {fix}")
            version = int(z["version"])
            if version != FORMAT_VERSION:
                raise SpecstackError(
                    f"{path} has suffix tree format version {version}, this specstack reads "
                    f"version {FORMAT_VERSION}; {fix}"
                )
            seq_ids = z["seq_ids"].tolist()
            lengths = z["seq_lengths"].tolist()
            seq_open = z["seq_open"].tolist()
            tokens = z["tokens"]
            depth = int(z["max_depth"])
            stored = Vocab(
                str(z["vocab_fingerprint"]) or None if "vocab_fingerprint" in z.files else None,
                int(z["n_vocab"]) if "n_vocab" in z.files and int(z["n_vocab"]) >= 0 else None,
            )
    except SpecstackError:
        raise
    except FileNotFoundError:
        raise SpecstackError(f"suffix tree cache {path} does not exist") from None
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as exc:
        raise SpecstackError(f"suffix tree cache {path} is unreadable ({exc}); {fix}") from None
    if (
        not len(lengths) == len(seq_ids) == len(seq_open)
        or len(set(seq_ids)) != len(seq_ids)
        or tokens.dtype != np.int32
        or tokens.ndim != 1
        or any(n < 0 for n in lengths)
        or sum(lengths) != len(tokens)
        or depth < 1
    ):
        raise SpecstackError(f"suffix tree cache {path} is corrupt (inconsistent arrays); {fix}")
    check_vocab(path, stored, expected, int(tokens.max()) if len(tokens) else -1)
    ends = np.cumsum(lengths, dtype=np.int64)
    return depth, [(sid, tokens[end - n : end].tolist(), is_open)
                   for sid, n, end, is_open in zip(seq_ids, lengths, ends.tolist(), seq_open)]
