"""llama.cpp's grammar engine: which tokens a GBNF grammar allows next, and JSON schemas as grammars.

Constrained decoding goes through llama.cpp's own grammar sampler (the one ``llama-server`` uses
for ``grammar``, ``json_schema`` and ``response_format``), never a hand-written constraint. A
``Grammar`` is one parse state: ``allowed`` asks about a few candidate ids (what the greedy path
needs: the constrained argmax is almost always among the top logits), ``mask`` about the whole
vocabulary (what sampling needs), ``accept`` advances the state by one token, and ``copy`` forks it,
so a draft can be walked without touching the committed state.
"""

from __future__ import annotations

import ctypes
import json
from typing import Any, Sequence

import numpy as np

from ..errors import InvalidParameterError
from .backend import llama_cpp_module

# llama_token_data as numpy sees it: id (int32), logit (float), p (float), 12 bytes, no padding.
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
_LOOSE_CHAR = r'char ::= [^"\\] |'
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def schema_to_gbnf(schema: dict[str, Any] | bool) -> str:
    """A JSON schema as a GBNF grammar, with llama.cpp's converter (``json_schema_to_gbnf``).

    ``True`` or ``{}`` means any JSON value, as OpenAI's ``json_object`` mode; a schema the converter
    cannot read is an ``InvalidParameterError`` naming the reason.
    """
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    if schema is True or schema == {}:
        schema = {}
    try:
        gbnf = json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:  # the converter raises plain exceptions (KeyError, ValueError, ...)
        raise InvalidParameterError(f"the JSON schema cannot be turned into a grammar: {exc!r}") from None
    # The Python port's string character admits raw control characters, which JSON forbids (llama.cpp's C++
    # converter excludes them): a newline inside a string would make the output unparseable.
    return gbnf.replace(_LOOSE_CHAR, _JSON_CHAR)


class Grammar:
    """One GBNF grammar's parse state over one model's vocabulary (llama.cpp's grammar sampler)."""

    def __init__(self, vocab: Any, gbnf: str, n_vocab: int, *, _sampler: Any = None) -> None:
        self._lc = llama_cpp_module()
        self._vocab = vocab
        self.gbnf = gbnf
        self.n_vocab = n_vocab
        if _sampler is None:
            _sampler = self._lc.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
            if not _sampler:
                raise InvalidParameterError("the grammar does not parse (llama.cpp's GBNF parser refused it; "
                                            "check it with llama.cpp's gbnf-validator or its docs/grammars)")
        self._smpl = _sampler
        self._cands: np.ndarray | None = None

    def copy(self) -> "Grammar":
        """An independent copy of this parse state (a draft is walked on a copy)."""
        return Grammar(self._vocab, self.gbnf, self.n_vocab, _sampler=self._lc.llama_sampler_clone(self._smpl))

    def allowed(self, token_ids: Sequence[int]) -> list[bool]:
        """Whether each of ``token_ids`` may come next (an end-of-generation token only where the grammar
        can end)."""
        n = len(token_ids)
        if n == 0:
            return []
        data = np.zeros(n, dtype=_TOKEN_DATA)
        data["id"] = token_ids
        self._apply(data)
        return (data["logit"] != -np.inf).tolist()

    def mask(self) -> np.ndarray:
        """A [n_vocab] bool array: which tokens the grammar allows next."""
        if self._cands is None:
            self._cands = np.zeros(self.n_vocab, dtype=_TOKEN_DATA)
        data = self._cands
        data["id"] = np.arange(self.n_vocab, dtype=np.int32)
        data["logit"] = 0.0
        self._apply(data)
        return data["logit"] != -np.inf

    def accept(self, token_id: int) -> None:
        """Advance by one token, which must be allowed (llama.cpp aborts on a refused one, so it is checked)."""
        if not self.allowed([token_id])[0]:
            raise ValueError(f"token {token_id} is not allowed by the grammar here")
        self._lc.llama_sampler_accept(self._smpl, int(token_id))

    def _apply(self, data: np.ndarray) -> None:
        lc = self._lc
        arr = lc.llama_token_data_array(data.ctypes.data_as(ctypes.POINTER(lc.llama_token_data)), len(data), -1, False)
        lc.llama_sampler_apply(self._smpl, ctypes.byref(arr))

    def __del__(self) -> None:
        smpl, self._smpl = getattr(self, "_smpl", None), None
        if smpl:
            self._lc.llama_sampler_free(smpl)
