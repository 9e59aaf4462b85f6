"""Token prefixes as chained hashes at chunk edges: what a replica holds, and how much of a prompt it holds.

A replica publishes one hash per ``CHUNK`` tokens of every sequence its slots
and host prompt cache keep (``h_i = hash(h_{i-1}, tokens[i*CHUNK:(i+1)*CHUNK])``);
the router hashes a prompt the same way and reads the longest run of its
hashes that a replica published.  Matching is by tokens, not characters, so
it measures exactly the KV a replica can reuse (up to a chunk), and a
published set is small (8 bytes per chunk) whatever the texts.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence

CHUNK = 16  # tokens per hash: finer costs more hashes per replica, coarser under-counts a match by up to this
MAX_PUBLISHED = 8192  # hashes one replica publishes at most (64 KiB): the newest sequences' first


def chain(tokens: Sequence[int], chunk: int = CHUNK) -> list[int]:
    """The hash of each whole chunk of ``tokens``, each chained to the ones before it (a prefix's identity)."""
    out, h = [], b""
    for end in range(chunk, len(tokens) + 1, chunk):
        data = h + b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens[end - chunk:end])
        h = hashlib.blake2b(data, digest_size=8).digest()
        out.append(int.from_bytes(h, "little") >> 1)  # 63 bits: fits msgpack's and JSON's integers
    return out


def published(sequences: Iterable[Sequence[int]], limit: int = MAX_PUBLISHED, chunk: int = CHUNK) -> list[int]:
    """The hashes of every chunk edge of ``sequences`` (most recent first), at most ``limit`` of them."""
    seen: dict[int, None] = {}
    for tokens in sequences:
        for h in chain(tokens, chunk):
            seen.setdefault(h)
            if len(seen) >= limit:
                return list(seen)
    return list(seen)


def matched(prompt_chain: Sequence[int], held: set[int] | frozenset[int], chunk: int = CHUNK) -> int:
    """Tokens of a prompt (given as its ``chain``) whose prefix ``held`` has: the longest run from the start."""
    n = 0
    for h in prompt_chain:
        if h not in held:
            break
        n += 1
    return n * chunk
