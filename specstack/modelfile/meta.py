"""GGUF metadata, interpreted: ``read_gguf`` and ``GGUFInfo``.

``gguf_read`` parses the file (tolerantly, without touching tensor data) and
``archs`` knows which architectures carry recurrent state; ``GGUFInfo`` turns
the raw key/value pairs into what callers ask: architecture, vocabulary and its
fingerprint, special tokens, file type, memory kind and rewind strategy.

    info = read_gguf("model.gguf")
    info.architecture, info.tokens, info.eos_id, info.n_params, info.file_type_name
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from dataclasses import asdict, dataclass
from typing import Any

import gguf
import numpy as np

from . import archs
from .read import GGUFFile, read_gguf_file

# llama_token_type: the `gguf` package leaves out 0 (LLAMA_TOKEN_TYPE_UNDEFINED in llama.h)
TOKEN_TYPE_NAMES = {0: "undefined", **{t.value: t.name.lower() for t in gguf.TokenType}}


def file_type_name(file_type: int) -> str:
    """``general.file_type`` (llama_ftype) as llama.cpp names it: ``Q4_K_M``, ``F16``; ``ftypeN`` if unknown."""
    try:
        name = gguf.LlamaFileType(file_type).name
    except ValueError:
        return f"ftype{file_type}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def read_gguf(path: str | os.PathLike, *, tensors: bool = True, role: str | None = None) -> GGUFInfo:
    """Read the metadata (and tensor infos) of a GGUF file without reading tensor data.

    Raises ``ModelLoadError`` for a missing, unreadable, non-GGUF, truncated or
    malformed file. Duplicate keys are tolerated: the last value wins and a
    warning is recorded in ``GGUFInfo.warnings``. With ``role`` (the target, a draft model), a missing or
    non-GGUF file is named by it.
    """
    return read_gguf_file(path, GGUFInfo, tensors=tensors, role=role)


@dataclass(frozen=True)
class HeadInfo:
    """A trained draft head's view of its target (``GGUFInfo.head``), plain data so a scan can cache it.

    ``kind``: eagle3, dflash or dspark; ``borrows_*``: the head has no ``token_embd``/``output`` of its own and
    reads the target's (through llama.cpp's ``ctx_other``), which needs the head's n_embd to be the target's."""

    kind: str
    n_vocab: int
    target_layers: tuple[int, ...]
    target_hidden_size: int | None
    n_embd: int | None
    block_size: int | None
    mask_token_id: int | None
    has_d2t: bool
    borrows_embeddings: bool
    borrows_output: bool

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "target_layers": list(self.target_layers)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadInfo:
        return cls(**{**d, "target_layers": tuple(d["target_layers"])})


class GGUFInfo(GGUFFile):
    """Everything in a GGUF file except the tensor data, with the keys callers need interpreted."""

    # ---- generic access -------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def _str(self, key: str) -> str | None:
        v = self.metadata.get(key)
        return v if isinstance(v, str) else None

    def _list(self, key: str) -> list:
        v = self.metadata.get(key)
        return v if isinstance(v, list) else []

    def _array(self, key: str) -> np.ndarray | None:
        v = self.metadata.get(key)
        return v if isinstance(v, np.ndarray) else None

    def _flag(self, key: str) -> bool | None:
        v = self.metadata.get(key)
        return bool(v) if v is not None else None

    def _int(self, key: str) -> int | None:
        v = self.metadata.get(key)
        return int(v) if isinstance(v, (int, np.integer)) else None

    def _arch_int(self, suffix: str) -> int | None:
        """``<architecture>.<suffix>``: llama.cpp namespaces hyperparameters by architecture."""
        arch = self.architecture
        return self._int(f"{arch}.{suffix}") if arch else None

    # ---- model ----------------------------------------------------------
    @property
    def architecture(self) -> str | None:
        return self._str("general.architecture")

    @property
    def name(self) -> str | None:
        return self._str("general.name")

    @property
    def context_length(self) -> int | None:
        return self._arch_int("context_length")

    @property
    def file_type(self) -> int | None:
        return self._int("general.file_type")

    @property
    def file_type_name(self) -> str | None:
        """Quantization name: from general.file_type, else the dominant tensor type."""
        ft = self.file_type
        if ft is not None:
            return file_type_name(ft)
        by_type: dict[str, int] = {}
        for t in self.tensors:
            if len(t.shape) >= 2:  # vectors (norms, biases) stay F32 in any quantization
                by_type[t.type_name] = by_type.get(t.type_name, 0) + t.n_elements
        if not by_type:
            return None
        return max(by_type.items(), key=lambda kv: kv[1])[0] + " (guessed)"

    @property
    def expert_count(self) -> int | None:
        return self._arch_int("expert_count")

    @property
    def expert_used_count(self) -> int | None:
        return self._arch_int("expert_used_count")

    def expert_override(self, n: int, what: str) -> tuple[str, int]:
        """The ``kv_overrides`` entry that runs this MoE model with ``n`` experts, checked (``what``: the flag or
        key that asked, for the error)."""
        from ..errors import InvalidParameterError, UnsupportedModelError

        count, used = self.expert_count, self.expert_used_count
        if not count:
            raise UnsupportedModelError(f"{what} needs a mixture-of-experts model; {self.path} has no experts "
                                        "(its metadata has no expert_count)")
        if not 1 <= n <= count:
            raise InvalidParameterError(f"{what}: {n} experts is not possible; {self.path} has {count} (default "
                                        f"{used} active)")
        return (f"{self.architecture}.expert_used_count", n)

    @property
    def nextn_layers(self) -> int:
        """Multi-token-prediction (NextN) layers, ``<arch>.nextn_predict_layers``: the last blocks of the file,
        a draft head shipped with the model (``--drafter mtp``); 0 where there are none."""
        return self._arch_int("nextn_predict_layers") or 0

    @property
    def mtp_mode(self) -> str | None:
        """How this llama.cpp drafts from the NextN layers (``archs.mtp_mode``); None without them or without an
        MTP graph for the architecture in this build."""
        return archs.mtp_mode(self.architecture) if self.nextn_layers > 0 else None

    @property
    def mtp_assistant_arch(self) -> str | None:
        """The architecture of the separate MTP head this model drafts with (``archs.mtp_assistant_arch``:
        gemma4's ``gemma4-assistant``); None where its head, if any, is in this GGUF."""
        return archs.mtp_assistant_arch(self.architecture)

    @property
    def block_count(self) -> int | None:
        """``<arch>.block_count``: the layers (llama.cpp's n_layer; a head's layer ids must stay below a target's)."""
        return self._arch_int("block_count")

    @property
    def embedding_length(self) -> int | None:
        """``<arch>.embedding_length``: n_embd, the width of a layer input row."""
        return self._arch_int("embedding_length")

    # ---- trained draft heads (eagle3, dflash: docs/design-eagle3-dflash.md) ----
    @property
    def is_head(self) -> bool:
        """An EAGLE-3 or DFlash head's GGUF: it drafts for a target, it is not a model to generate with."""
        return archs.is_head(self.architecture)

    @property
    def target_layers(self) -> tuple[int, ...]:
        """``<arch>.target_layers``: the target layers whose inputs a head reads, in llama.cpp's layer-input
        convention (id i = the residual stream entering block i; 0 = the token embeddings); () where absent."""
        arch = self.architecture
        v = self.metadata.get(f"{arch}.target_layers") if arch else None
        if isinstance(v, np.ndarray):
            return tuple(int(i) for i in v)
        if isinstance(v, list):
            return tuple(int(i) for i in v if isinstance(i, (int, np.integer)))
        return ()

    @property
    def target_hidden_size(self) -> int | None:
        """``<arch>.target_hidden_size`` (eagle3): the target's n_embd the head was trained on."""
        return self._arch_int("target_hidden_size")

    @property
    def block_size(self) -> int | None:
        """``<arch>.block_size`` (dflash): the block a DFlash head denoises at once; drafts are at most one less."""
        return self._arch_int("block_size")

    @property
    def mask_token_id(self) -> int | None:
        """``tokenizer.ggml.mask_token_id``: the token a DFlash block is filled with (without it llama.cpp rejects
        every block)."""
        return self._id("mask")

    def _has_tensor(self, name: str) -> bool:
        return any(t.name == name for t in self.tensors)

    @property
    def has_d2t(self) -> bool:
        """A ``d2t`` tensor: the head drafts from a reduced vocabulary, mapped to target ids (needs tensor infos)."""
        return self._has_tensor("d2t")

    @property
    def is_dspark(self) -> bool:
        """A dflash GGUF with DSpark's Markov tensors (``markov_w1.weight``), llama.cpp's own rule for draft-dspark
        (common/speculative.cpp, common_speculative_types_from_gguf; needs tensor infos)."""
        return self.architecture == "dflash" and self._has_tensor("markov_w1.weight")

    @property
    def head(self) -> HeadInfo | None:
        """What this head's GGUF says about the target it reads; None where it is not a head."""
        if not self.is_head:
            return None
        arch = str(self.architecture)
        return HeadInfo(kind="dspark" if self.is_dspark else arch, n_vocab=self.n_vocab,
                        target_layers=self.target_layers, target_hidden_size=self.target_hidden_size, n_embd=self.embedding_length,
                        block_size=self.block_size, mask_token_id=self.mask_token_id, has_d2t=self.has_d2t,
                        borrows_embeddings=not self._has_tensor("token_embd.weight"),
                        borrows_output=not self._has_tensor("output.weight"))

    @property
    def is_recurrent(self) -> bool:
        """Purely recurrent (state-space / RWKV): its state cannot be cut back by position."""
        return archs.is_recurrent(self.architecture)

    @property
    def is_hybrid(self) -> bool:
        """Attention plus recurrent layers: the recurrent part needs rollback or checkpoints too."""
        return archs.is_hybrid(self.architecture)

    @property
    def recurrence(self) -> str:
        return archs.recurrence(self.architecture)

    @property
    def rewind(self) -> str:
        """How speculation takes rejected tokens back (``recurrent``): truncate, rollback or checkpoint."""
        return archs.rewind(self.architecture)

    # ---- tokenizer ------------------------------------------------------
    @property
    def tokenizer_model(self) -> str | None:
        return self._str("tokenizer.ggml.model")

    @property
    def pre(self) -> str | None:
        return self._str("tokenizer.ggml.pre")

    @property
    def tokens(self) -> list[str]:
        return self._list("tokenizer.ggml.tokens")

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @property
    def token_types(self) -> np.ndarray | None:
        return self._array("tokenizer.ggml.token_type")

    @property
    def scores(self) -> np.ndarray | None:
        return self._array("tokenizer.ggml.scores")

    @property
    def output_share(self) -> float | None:
        """The output layer's share of the weights' bytes (``output.weight``, else the tied ``token_embd.weight``);
        None without tensor infos. Every verified row runs it, so where it is large (Gemma 3 270M Q4_K_M: 72%; a
        7B model: a few percent) a row's cost is mostly that layer's, and a bigger model of the family can differ."""
        sizes = {t.name: t.n_bytes for t in self.tensors}
        out = sizes["output.weight"] if "output.weight" in sizes else sizes.get("token_embd.weight")
        total = sum(b for b in sizes.values() if b)
        return out / total if out and total else None

    @property
    def merges(self) -> list[str]:
        return self._list("tokenizer.ggml.merges")

    def _id(self, what: str) -> int | None:
        """A special token id; a bool stored there is not an id."""
        v = self.metadata.get(f"tokenizer.ggml.{what}_token_id")
        return int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else None

    @property
    def bos_id(self) -> int | None:
        return self._id("bos")

    @property
    def eos_id(self) -> int | None:
        return self._id("eos")

    @property
    def eot_id(self) -> int | None:
        return self._id("eot")

    @property
    def pad_id(self) -> int | None:
        return self._id("padding")

    @property
    def add_bos(self) -> bool | None:
        return self._flag("tokenizer.ggml.add_bos_token")

    @property
    def add_eos(self) -> bool | None:
        return self._flag("tokenizer.ggml.add_eos_token")

    def special_tokens(self) -> dict[str, Any]:
        return {"bos": self.bos_id, "eos": self.eos_id, "eot": self.eot_id, "pad": self.pad_id,
                "add_bos": self.add_bos, "add_eos": self.add_eos}

    def string_array_bytes(self, key: str) -> bytes:
        """A string array as GGUF stores it little-endian: per string a u64 length and UTF-8.

        The stored bytes when the reader kept them (``raw_arrays``), else rebuilt (big-endian files),
        so fingerprints and scan digests do not depend on byte order."""
        raw = self.raw_arrays.get(key)
        if raw is not None:
            return raw
        parts = []
        for t in self.metadata.get(key) or []:
            b = t.encode("utf-8", "surrogateescape")
            parts.append(struct.pack("<Q", len(b)))
            parts.append(b)
        return b"".join(parts)

    @functools.cached_property
    def vocab_fingerprint(self) -> str | None:
        """sha256 over the token texts and the special ids (None without a vocabulary)."""
        if not self.tokens:
            return None
        h = hashlib.sha256(self.string_array_bytes("tokenizer.ggml.tokens"))
        h.update(repr(sorted(self.special_tokens().items())).encode())
        return h.hexdigest()
