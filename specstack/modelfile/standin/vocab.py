"""A smaller vocabulary for a stand-in (``--vocab N``): which tokens stay, and the tokenizer fields that say so.

Why: the output layer's share of a decode step is what makes a verified row dear, and Gemma 3's 262,144 rows are
an extreme. Real 1-2B models have 128,256 (Llama 3) or 151,936 (Qwen 2.5) rows, so a stand-in meant to cost
like one of them needs that many rows, not the source's.

How: a SentencePiece vocabulary (``tokenizer.ggml.model`` "llama", no merges) tokenizes by the pieces it
has and their scores, falling back to single characters and bytes. So dropping pieces leaves a working
tokenizer that splits the text those pieces covered into smaller ones. Which stay: ``kept_tokens``; in
short, English and code keep their pieces and other scripts lose theirs first, because the workloads
measured on stand-ins are English and code. Kept tokens keep their order, so ids below the first
dropped one do not move.

What it costs: the stand-in no longer computes exactly the source's function. It never emits a dropped
piece (its greedy choice is the best kept one) and it reads text that held one as smaller pieces. How
often outputs differ on real prompts is measured in ``docs/standin.md``. BPE vocabularies (with merges)
are refused: their merges name the pieces, and dropping one breaks the merges that build on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import InvalidParameterError, UnsupportedModelError

if TYPE_CHECKING:
    from gguf import GGUFReader

NORMAL = 1  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL
TOKENS, SCORES, TYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"


def _pieces(reader: GGUFReader) -> list[bytes]:
    f = reader.fields[TOKENS]
    return [bytes(f.parts[i]) for i in f.data]


def _id_fields(reader: GGUFReader) -> dict[str, int]:
    """Every ``tokenizer.ggml.*_token_id`` field and the token it names (refused where it names none)."""
    n = len(reader.fields[TOKENS].data)
    ids = {name: int(f.contents()) for name, f in reader.fields.items()
           if name.startswith("tokenizer.ggml.") and name.endswith("_token_id")}
    for name, i in ids.items():
        if not 0 <= i < n:
            raise UnsupportedModelError(f"the source's {name} is {i}, outside its {n} tokens, so --vocab cannot "
                                        "tell which token to keep for it; mend the source's tokenizer or leave --vocab out")
    return ids


def check_vocab_source(reader: GGUFReader) -> None:
    """Refuse a source whose vocabulary cannot lose pieces (anything but SentencePiece with scores and types)."""
    model = reader.fields.get("tokenizer.ggml.model")
    kind = model.contents() if model is not None else None
    if kind != "llama" or "tokenizer.ggml.merges" in reader.fields:
        raise UnsupportedModelError(
            f"--vocab needs a SentencePiece vocabulary (tokenizer.ggml.model 'llama', as Gemma 3 has); this source's "
            f"is {kind!r}{' with merges' if 'tokenizer.ggml.merges' in reader.fields else ''}, whose pieces cannot "
            "be dropped without breaking its tokenizer. Leave --vocab out")
    for key in (TOKENS, SCORES, TYPES):
        if key not in reader.fields:
            raise UnsupportedModelError(f"--vocab needs the source's {key}, which it lacks. Leave --vocab out")


def _ranks(pieces: list[bytes], types: np.ndarray) -> np.ndarray:
    """Each token's class: 0 kept whatever N is, then 1, 2, .. in the order the rest fill the vocabulary."""
    text = [p.decode("utf-8", "replace").replace("\u2581", " ") for p in pieces]  # the SentencePiece space
    rank = np.zeros(len(pieces), dtype=np.int8)
    for i, (t, kind) in enumerate(zip(text, types)):
        if kind != NORMAL:
            rank[i] = 4 if pieces[i].startswith(b"<unused") else 0  # reserved slots, in no text
        elif len(t) == 1:
            rank[i] = 0 if t.isascii() else 2
        else:
            rank[i] = 1 if t.isascii() else 3
    return rank


def kept_tokens(reader: GGUFReader, n: int) -> np.ndarray:
    """The source ids the stand-in keeps, ascending (stand-in id i is source id ``kept[i]``).

    Kept whatever ``n`` is: control, user-defined, byte and unknown tokens, the tokens a
    ``tokenizer.ggml.*_token_id`` field names, and ASCII single characters. Then, until there are ``n``:
    multi-character ASCII pieces (English and code), other single characters, other multi-character
    pieces, reserved ``<unused..>`` slots; in id order within each. A SentencePiece vocabulary lists its
    pieces from the most frequent down, and puts the ones added by hand (Llama 2's runs of spaces, scored
    -1e9 so that they never merge by score) among the first, so id order keeps both where scores would
    drop the second. So English and code tokenize as in the source as long as its ASCII pieces fit
    (Gemma 3: 143,775 of them)."""
    check_vocab_source(reader)
    pieces = _pieces(reader)
    types = np.asarray(reader.fields[TYPES].contents())
    if n > len(pieces):
        raise InvalidParameterError(f"--vocab {n} is more than the source's {len(pieces)} tokens; a stand-in can "
                                    "only drop tokens")
    rank = _ranks(pieces, types)
    rank[list(_id_fields(reader).values())] = 0
    must = np.flatnonzero(rank == 0)
    if n < len(must):
        raise InvalidParameterError(
            f"--vocab {n} is fewer than the {len(must)} tokens this vocabulary cannot lose (control, byte and "
            f"ASCII single-character pieces); give at least {len(must)}")
    rest = np.flatnonzero(rank > 0)
    order = rest[np.argsort(rank[rest], kind="stable")]  # by class, then id
    return np.sort(np.concatenate([must, order[: n - len(must)]]))


def vocab_fields(reader: GGUFReader, kept: np.ndarray) -> dict[str, Any]:
    """The tokenizer fields of the kept vocabulary: pieces, scores and types cut to ``kept``, token ids renumbered."""
    new_id = {int(old): new for new, old in enumerate(kept)}
    pieces = _pieces(reader)
    out: dict[str, Any] = {
        TOKENS: [pieces[i] for i in kept],
        SCORES: [float(x) for x in np.asarray(reader.fields[SCORES].contents())[kept]],
        TYPES: [int(x) for x in np.asarray(reader.fields[TYPES].contents())[kept]],
    }
    for name, old in _id_fields(reader).items():
        out[name] = new_id[old]
    return out
