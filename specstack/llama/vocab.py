"""Tokenizing and detokenizing through llama.cpp's vocabulary, with or without weights loaded."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import InvalidParameterError, ModelLoadError
from .backend import init_backend, llama_cpp_module, check_gguf_file

# llama.cpp's token attributes (llama.h ``llama_token_attr``): the ones its special-token cache holds, which
# ``parse_special`` matches in text, and the strip flags some vocabularies set on them.
ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED = 1 << 0, 1 << 3, 1 << 4
ATTR_LSTRIP, ATTR_RSTRIP = 1 << 7, 1 << 8
SPECIAL_ATTRS = ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED
FIM_NAMES = ("pre", "suf", "mid", "rep", "sep")  # llama.h's llama_vocab_fim_*: fill-in-the-middle tokens

if TYPE_CHECKING:
    from .grammar_engine import GrammarEngine, GrammarState
    from .target import GrammarTarget


class Vocabulary:
    """Token <-> text for a loaded model (a mixin of ``LlamaModel`` and ``VocabModel``)."""

    _lc: Any  # the llama_cpp module
    _vocab: Any
    n_vocab: int
    _piece_cache: dict[int, bytes]

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text (or raw UTF-8 bytes) to token ids; ``add_special`` adds BOS when the model asks for it.

        ``parse_special`` reads control tokens written as text (``<start_of_turn>``) as those tokens: chat
        templates write them so; a user's own prompt text is never parsed that way (as llama-server).
        """
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        cap = len(data) + 8
        buf = (ctypes.c_int32 * cap)()
        n = self._lc.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (ctypes.c_int32 * cap)()
            n = self._lc.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def split_special(self, text: str) -> list[str | int]:
        """Trusted text (a chat template's own markup) cut as llama.cpp's ``parse_special`` cuts it: raw text
        pieces and the ids of the special tokens written in it, in order.

        Chat prompts are tokenized from these pieces, so that only the template can write control tokens and a
        message's content stays plain text however it is spelled (``server.chat.chat_tokens``).
        """
        ids = self.tokenize(text, add_special=False, parse_special=True)
        out: list[str | int] = []
        pos = 0
        for token in ids:
            attr = int(self._lc.llama_vocab_get_attr(self._vocab, token))
            if not attr & SPECIAL_ATTRS:
                continue
            piece = self.special_text(token)
            at = text.find(piece, pos) if piece else -1
            if at < 0:  # not spelled in the text (cannot happen for a parsed special); keep it in order
                out.append(token)
                continue
            left = text[pos:at]
            if attr & ATTR_LSTRIP:
                left = left.rstrip()
            if left:
                out.append(left)
            out.append(token)
            pos = at + len(piece)
            if attr & ATTR_RSTRIP:
                while pos < len(text) and text[pos].isspace():
                    pos += 1
        if pos < len(text):
            out.append(text[pos:])
        return out

    def special_text(self, token: int) -> str:
        """How a special token is written in text (``<end_of_turn>``), as ``parse_special`` reads it."""
        buf = ctypes.create_string_buffer(64)
        n = self._lc.llama_token_to_piece(self._vocab, token, buf, 64, 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lc.llama_token_to_piece(self._vocab, token, buf, -n, 0, True)
        return buf.raw[:n].decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token's text (cached: called for every output token).  A special token has none,
        unless the model was loaded with ``ModelConfig.special`` (llama.cpp's --special: spelled out, as
        ``special_text``), so that what is served, stop strings included, reads as llama-server's output does."""
        piece = self._piece_cache.get(token)
        if piece is None:
            special = bool(getattr(getattr(self, "config", None), "special", False))
            buf = ctypes.create_string_buffer(64)
            n = self._lc.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self._lc.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
            piece = buf.raw[:n]
            self._piece_cache[token] = piece
        return piece

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        """End of generation (EOS, EOT, ...) as the model's vocabulary defines it."""
        return bool(self._lc.llama_vocab_is_eog(self._vocab, token))

    def fim_ids(self) -> dict[str, int | None]:
        """The fill-in-the-middle tokens the GGUF names (``pre``, ``suf``, ``mid``, ``rep``, ``sep``; None where
        it names none), as llama-server's ``/infill`` reads them."""
        return {name: (None if t < 0 else t) for name in FIM_NAMES
                for t in (int(getattr(self._lc, f"llama_vocab_fim_{name}")(self._vocab)),)}

    def eog_ids(self) -> frozenset[int]:
        """All end-of-generation ids, computed once so the loop tests set membership."""
        if not hasattr(self, "_eog"):
            self._eog = frozenset(t for t in range(self.n_vocab) if self.is_eog(t))
        return self._eog

    def grammar(self, gbnf: str) -> "GrammarState":
        """A GBNF grammar's start state over this vocabulary (on the engine ``grammar.choose_engine`` picks), a copy
        of the cached one."""
        return self.grammar_engine().get(gbnf)

    def grammar_engine(self) -> "GrammarEngine":
        """This vocabulary's grammar engine (``grammar.GrammarCache``): grammars prepared ahead, off the caller's
        thread (a server awaits this before a request reaches the engine), and its view of the vocabulary warmed at
        load, so a server's first constrained request does not wait seconds for it."""
        cache = self.__dict__.get("_grammars")
        if cache is None:
            from .grammar import GrammarCache

            cache = self.__dict__.setdefault("_grammars", GrammarCache(self._vocab, self.n_vocab, self.eog_ids()))
        return cache

    def adopt_grammars(self, keeper: "GrammarTarget") -> None:
        """Take ``keeper``'s grammar engine (its view of the vocabulary, the grammars built, the spellings learnt) as
        this vocabulary's: ``keeper`` is the same GGUF's tokenizer loaded apart, and outlives this model (a sleeping
        role's model is freed and loaded again; ``server.worker.RoleWorker._keep_grammars``)."""
        self.__dict__["_grammars"] = keeper.grammar_engine()


class VocabModel(Vocabulary):
    """A GGUF's tokenizer alone (llama.cpp's vocab-only load: no weights, no context)."""

    def __init__(self, path: str | Path, role: str = "tokenizer model") -> None:
        self.path = check_gguf_file(path, role)
        init_backend()
        self._lc = lc = llama_cpp_module()
        params = lc.llama_model_default_params()
        params.vocab_only = True
        self._model = lc.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ModelLoadError(f"cannot load the tokenizer of {self.path}")
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self._vocab))
        self.bos_id = int(lc.llama_vocab_bos(self._vocab))  # -1: none, as ``LlamaModel``'s
        self.eos_id = int(lc.llama_vocab_eos(self._vocab))
        self._piece_cache: dict[int, bytes] = {}

    def close(self) -> None:
        if getattr(self, "_model", None):
            self._lc.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def check_grammar(model: str | Path, gbnf: str | None, where: str = "--grammar") -> None:
    """``gbnf`` parsed on ``model``'s vocabulary before anything else loads (a vocabulary-only load: a grammar
    that does not parse fails in a second, not after a big model's load)."""
    if not gbnf:
        return
    vocab = VocabModel(model)
    try:
        vocab.grammar(gbnf)
    except InvalidParameterError as exc:
        raise InvalidParameterError(f"{where}: {exc}") from None
    finally:
        vocab.close()
