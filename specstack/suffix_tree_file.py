"""The suffix tree's file (``--suffix-cache``): its sequences in an ``.npz``, written atomically.

A tree is a function of its sequences (canonical compression and a fixed
tie rule), so the file stores tokens, not nodes: it stays small, saves fast,
and ``SuffixTree.load`` replays the sequences to rebuild the tree exactly.
This module knows the format only; ``SuffixTree.save``/``load`` use it.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Sequence

import numpy as np

from .errors import SpecstackError

FORMAT = "specstack-suffix-tree"
FORMAT_VERSION = 1

Stored = tuple[int, Sequence[int], bool]  # (sequence id, its tokens, still open)


def write(path: str | Path, max_depth: int, sequences: Sequence[Stored]) -> None:
    """Write ``sequences`` (in order) to ``path`` through a temporary file: a crash never leaves half a file."""
    parts = [np.asarray(tokens, dtype=np.int32) for _, tokens, _ in sequences]
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(
            f,
            format=np.array(FORMAT),
            version=np.array(FORMAT_VERSION),
            max_depth=np.array(max_depth),
            seq_ids=np.array([sid for sid, _, _ in sequences], dtype=np.int64),
            seq_lengths=np.array([len(p) for p in parts], dtype=np.int64),
            seq_open=np.array([is_open for _, _, is_open in sequences], dtype=np.bool_),
            tokens=np.concatenate(parts) if parts else np.zeros(0, np.int32),
        )
    tmp.replace(path)


def read(path: str | Path) -> tuple[int, list[Stored]]:
    """(max_depth, sequences) from a file ``write`` made.

    Anything that is not such a file raises SpecstackError naming the file and the fix.
    """
    path = Path(path)
    fix = f"delete {path} (it is only a cache) or point cache_path at another file"
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
    ends = np.cumsum(lengths, dtype=np.int64)
    return depth, [(sid, tokens[end - n : end].tolist(), is_open)
                   for sid, n, end, is_open in zip(seq_ids, lengths, ends.tolist(), seq_open)]
