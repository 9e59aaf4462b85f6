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

Two modules: ``store`` opens a store and answers queries (what the ``rest``
drafter needs); ``build`` sorts the suffixes, writes stores and ingests a
corpus of files (what ``specstack datastore build`` needs).
"""

from .build import BuildResult, build_from_files, build_suffix_array, collect_files, write_store
from .store import SENTINEL, Datastore

__all__ = [
    "Datastore",
    "BuildResult",
    "build_suffix_array",
    "write_store",
    "collect_files",
    "build_from_files",
    "SENTINEL",
]
