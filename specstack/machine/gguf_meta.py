"""A small, tolerant GGUF *metadata* reader.

Reads the header, the key/value section and the tensor infos of a GGUF file
(v2, v3; little- or big-endian) without ever touching tensor data, so it is
fast even on multi-gigabyte models and on 100k-token vocabularies.

Unlike ``gguf.GGUFReader`` it tolerates duplicated keys (the last value wins and
a warning is recorded), and every problem with the file becomes a
``ModelLoadError`` that names the file, what was wrong and what to do.

    info = read_gguf("model.gguf")
    info.architecture, info.tokens, info.eos_id, info.n_params, info.file_type_name
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

from ..errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = gguf.GGUF_DEFAULT_ALIGNMENT

# ggml's tables (value types, tensor types and their block sizes, file types, token types) come from
# the `gguf` package, pinned beside llama-cpp-python, so they follow ggml as it adds types.
# numpy dtype per scalar value type, as stored (a bool is one byte; any non-zero byte is true):
_NP_DTYPE = {t: np.dtype(np.uint8 if t == GGUFValueType.BOOL else np_type)
             for t, np_type in gguf.GGUFReader.gguf_scalar_to_np.items()}

# llama_token_type: the `gguf` package leaves out 0 (LLAMA_TOKEN_TYPE_UNDEFINED in llama.h)
TOKEN_TYPE_NAMES = {0: "undefined", **{t.value: t.name.lower() for t in gguf.TokenType}}


def ggml_type_name(ggml_type: int) -> str:
    """A tensor type's ggml name (``F16``, ``Q4_K``); ``typeN`` for one this gguf package does not know."""
    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type{ggml_type}"


def file_type_name(file_type: int) -> str:
    """``general.file_type`` (llama_ftype) as llama.cpp names it: ``Q4_K_M``, ``F16``; ``ftypeN`` if unknown."""
    try:
        name = gguf.LlamaFileType(file_type).name
    except ValueError:
        return f"ftype{file_type}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


# Architecture names (general.architecture) whose models carry recurrent state.
# From llm_arch_is_recurrent / llm_arch_is_hybrid / llm_arch_supports_rs_rollback in the llama.cpp
# vendored by llama-cpp-python 0.3.36 (src/llama-arch.cpp).  The loaded model is asked too
# (``target.LlamaModel.memory`` / ``.strategy``); these lists let `check` answer without loading.
RECURRENT_ARCHS = ("mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7")
HYBRID_ARCHS = (
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe",
    "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp",
    "deepseek4", "minimax-01",
)
ROLLBACK_ARCHS = (
    "kimi-k3", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next", "nemotron_h", "nemotron_h_moe",
    "lfm2", "lfm2moe", "bailingmoe3",
)

# sanity limits that tell garbage from a merely truncated file
_MAX_STRING = 1 << 32
_MAX_COUNT = 1 << 32
_RAW_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
_FIX_HINT = "re-download or re-convert the model (e.g. with llama.cpp's convert_hf_to_gguf.py)"


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)

    @property
    def n_bytes(self) -> int | None:
        """Bytes of tensor data (None for a type this gguf package does not know)."""
        sizes = gguf.GGML_QUANT_SIZES.get(self.ggml_type)
        if sizes is None:
            return None
        block, size = sizes
        return (self.n_elements + block - 1) // block * size


@dataclass
class GGUFInfo:
    """Everything in a GGUF file except the tensor data."""

    path: Path
    version: int
    metadata: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    tensor_count: int = 0
    n_params: int = 0
    tensor_bytes: int = 0
    file_size: int = 0
    byte_order: str = "little"
    tensors: list[TensorInfo] = field(default_factory=list, repr=False)
    value_types: dict[str, str] = field(default_factory=dict, repr=False)
    # raw little-endian bytes (u64 length + UTF-8, per string) of the big string arrays
    raw_arrays: dict[str, bytes] = field(default_factory=dict, repr=False)

    # ---- generic access -------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def _arch_key(self, suffix: str, default: Any = None) -> Any:
        arch = self.architecture
        if arch and f"{arch}.{suffix}" in self.metadata:
            return self.metadata[f"{arch}.{suffix}"]
        return default

    # ---- model ----------------------------------------------------------
    @property
    def architecture(self) -> str | None:
        a = self.metadata.get("general.architecture")
        return a if isinstance(a, str) else None

    @property
    def name(self) -> str | None:
        n = self.metadata.get("general.name")
        return n if isinstance(n, str) else None

    @property
    def context_length(self) -> int | None:
        v = self._arch_key("context_length")
        return int(v) if isinstance(v, (int, np.integer)) else None

    @property
    def file_type(self) -> int | None:
        v = self.metadata.get("general.file_type")
        return int(v) if isinstance(v, (int, np.integer)) else None

    @property
    def file_type_name(self) -> str | None:
        """Quantization name: from general.file_type, else the dominant tensor type."""
        ft = self.file_type
        if ft is not None:
            return file_type_name(ft)
        if not self.tensors:
            return None
        by_type: dict[str, int] = {}
        for t in self.tensors:
            if len(t.shape) >= 2:
                by_type[t.type_name] = by_type.get(t.type_name, 0) + t.n_elements
        if not by_type:
            return None
        return max(by_type.items(), key=lambda kv: kv[1])[0] + " (guessed)"

    @property
    def expert_count(self) -> int | None:
        v = self._arch_key("expert_count")
        return int(v) if isinstance(v, (int, np.integer)) else None

    @property
    def expert_used_count(self) -> int | None:
        v = self._arch_key("expert_used_count")
        return int(v) if isinstance(v, (int, np.integer)) else None

    @property
    def is_recurrent(self) -> bool:
        """Purely recurrent (state-space / RWKV): its state cannot be cut back by position."""
        return (self.architecture or "").lower() in RECURRENT_ARCHS

    @property
    def is_hybrid(self) -> bool:
        """Attention plus recurrent layers: the recurrent part needs rollback or checkpoints too."""
        return (self.architecture or "").lower() in HYBRID_ARCHS

    @property
    def recurrence(self) -> str:
        return "recurrent" if self.is_recurrent else "hybrid" if self.is_hybrid else "none"

    @property
    def rewind(self) -> str:
        """How speculation takes rejected tokens back (``recurrent``): truncate, rollback or checkpoint."""
        if self.recurrence == "none":
            return "truncate"
        return "rollback" if (self.architecture or "").lower() in ROLLBACK_ARCHS else "checkpoint"

    # ---- tokenizer ------------------------------------------------------
    @property
    def tokenizer_model(self) -> str | None:
        v = self.metadata.get("tokenizer.ggml.model")
        return v if isinstance(v, str) else None

    @property
    def pre(self) -> str | None:
        v = self.metadata.get("tokenizer.ggml.pre")
        return v if isinstance(v, str) else None

    @property
    def tokens(self) -> list[str]:
        v = self.metadata.get("tokenizer.ggml.tokens")
        return v if isinstance(v, list) else []

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @property
    def token_types(self) -> np.ndarray | None:
        v = self.metadata.get("tokenizer.ggml.token_type")
        return v if isinstance(v, np.ndarray) else None

    @property
    def scores(self) -> np.ndarray | None:
        v = self.metadata.get("tokenizer.ggml.scores")
        return v if isinstance(v, np.ndarray) else None

    @property
    def merges(self) -> list[str]:
        v = self.metadata.get("tokenizer.ggml.merges")
        return v if isinstance(v, list) else []

    def _id(self, what: str) -> int | None:
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
        v = self.metadata.get("tokenizer.ggml.add_bos_token")
        return bool(v) if v is not None else None

    @property
    def add_eos(self) -> bool | None:
        v = self.metadata.get("tokenizer.ggml.add_eos_token")
        return bool(v) if v is not None else None

    def special_tokens(self) -> dict[str, Any]:
        return {"bos": self.bos_id, "eos": self.eos_id, "eot": self.eot_id, "pad": self.pad_id,
                "add_bos": self.add_bos, "add_eos": self.add_eos}

    def string_array_bytes(self, key: str) -> bytes:
        """A string array as GGUF stores it little-endian: per string a u64 length and UTF-8."""
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


class _Truncated(Exception):
    pass


class _Parser:
    def __init__(self, buf, size: int, endian: str):
        self.buf = buf
        self.size = size
        self.pos = 0
        self.e = endian
        self._structs: dict[str, struct.Struct] = {}

    def _st(self, fmt: str) -> struct.Struct:
        s = self._structs.get(fmt)
        if s is None:
            s = self._structs[fmt] = struct.Struct(self.e + fmt)
        return s

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise _Truncated()

    def scalar(self, fmt: str):
        s = self._st(fmt)
        if self.pos + s.size > self.size:
            raise _Truncated()
        (v,) = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return v

    def raw_string(self) -> bytes:
        n = self.scalar("Q")
        if n > self.size - self.pos:
            if n > _MAX_STRING:
                raise ValueError(f"implausible string length {n}")
            raise _Truncated()
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return bytes(b)

    def string(self) -> str:
        return self.raw_string().decode("utf-8", "surrogateescape")

    def string_array(self, count: int) -> list[str]:
        buf, size, pos = self.buf, self.size, self.pos
        unpack = self._st("Q").unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise _Truncated()
            (n,) = unpack(buf, pos)
            pos += 8
            end = pos + n
            if end > size:
                self.pos = pos
                if n > _MAX_STRING:
                    raise ValueError(f"implausible string length {n}")
                raise _Truncated()
            append(buf[pos:end].decode("utf-8", "surrogateescape"))
            pos = end
        self.pos = pos
        return out

    def numbers(self, vtype: int, count: int) -> np.ndarray:
        """``count`` numbers of scalar value type ``vtype``, in native byte order (bools as bool)."""
        dt = _NP_DTYPE[vtype].newbyteorder(self.e)
        nbytes = count * dt.itemsize
        self.need(nbytes)
        arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
        self.pos += nbytes
        if vtype == GGUFValueType.BOOL:
            return arr.astype(bool)
        return arr.astype(arr.dtype.newbyteorder("=")) if self.e == ">" else arr

    def value(self, vtype: int, depth: int = 0):
        if vtype in _NP_DTYPE:
            return self.numbers(vtype, 1)[0].item()
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype != GGUFValueType.ARRAY:
            raise ValueError(f"unknown value type {vtype}")
        if depth > 4:
            raise ValueError("arrays nested too deeply")
        etype = self.scalar("I")
        count = self.scalar("Q")
        if count > _MAX_COUNT:
            raise ValueError(f"implausible array length {count}")
        if etype in _NP_DTYPE:
            return self.numbers(etype, count)
        if etype == GGUFValueType.STRING:
            return self.string_array(count)
        if etype == GGUFValueType.ARRAY:
            return [self.value(GGUFValueType.ARRAY, depth + 1) for _ in range(count)]
        raise ValueError(f"unknown array element type {etype}")


def _fail(path: Path, problem: str, hint: str = _FIX_HINT) -> ModelLoadError:
    return ModelLoadError(f"{path}: {problem}; {hint}")


def read_gguf(path: str | os.PathLike, *, tensors: bool = True) -> GGUFInfo:
    """Read the metadata (and tensor infos) of a GGUF file without reading tensor data.

    Raises ``ModelLoadError`` for a missing, unreadable, non-GGUF, truncated or
    malformed file. Duplicate keys are tolerated: the last value wins and a
    warning is recorded in ``GGUFInfo.warnings``.
    """
    p = Path(path)
    try:
        f = open(p, "rb")
    except FileNotFoundError:
        raise ModelLoadError(f"{p}: no such file; check the path (bundled models live in specstack/models)") from None
    except IsADirectoryError:
        raise ModelLoadError(f"{p}: is a folder, not a GGUF file; give the path of a .gguf file") from None
    except OSError as exc:
        raise ModelLoadError(f"{p}: cannot open ({exc.strerror or exc}); check the file's permissions") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise _fail(p, "empty file (0 bytes), not a GGUF model")
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            mm = None
        buf = mm if mm is not None else f.read()
        try:
            return _parse(p, buf, size, tensors)
        finally:
            if mm is not None:
                mm.close()


def _parse(p: Path, buf, size: int, want_tensors: bool) -> GGUFInfo:
    magic = bytes(buf[:4])
    if magic != GGUF_MAGIC:
        if len(magic) < 4:
            raise _fail(p, f"not a GGUF file (only {size} bytes)")
        raise _fail(p, f"not a GGUF file (magic {magic!r}, expected b'GGUF')",
                    "give the path of a .gguf model file")
    if size < 8:
        raise _fail(p, "truncated while reading the header")
    (v_le,) = struct.unpack_from("<I", buf, 4)
    (v_be,) = struct.unpack_from(">I", buf, 4)
    if v_le == 1 or v_be == 1:
        raise _fail(p, "GGUF version 1 (from 2023) is no longer supported by llama.cpp",
                    "re-convert the model with a current llama.cpp")
    if 2 <= v_le <= 3:
        endian, version = "<", v_le
    elif 2 <= v_be <= 3:
        endian, version = ">", v_be
    else:
        raise _fail(p, f"unsupported GGUF version {v_le}",
                    "this reader knows versions 2 and 3; update specstack or re-convert the model")
    ps = _Parser(buf, size, endian)
    ps.pos = 8
    count_fmt = "Q"
    try:
        n_tensors = ps.scalar(count_fmt)
        n_kv = ps.scalar(count_fmt)
    except _Truncated:
        raise _fail(p, "truncated while reading the header") from None
    if n_kv > _MAX_COUNT or n_tensors > _MAX_COUNT:
        raise _fail(p, f"malformed header (claims {n_kv} metadata keys and {n_tensors} tensors "
                       f"in a {size}-byte file)")

    metadata: dict[str, Any] = {}
    value_types: dict[str, str] = {}
    warnings: list[str] = []
    raw_arrays: dict[str, bytes] = {}
    key = None
    for i in range(n_kv):
        key = None
        try:
            key = ps.string()
            vtype = ps.scalar("I")
            start = ps.pos
            val = ps.value(vtype)
        except _Truncated:
            what = f"key #{i}" + (f" ({key!r})" if key else "")
            raise _fail(p, f"truncated while reading {what} of {n_kv} (file is {size} bytes)",
                        "the download or copy is incomplete; " + _FIX_HINT) from None
        except ValueError as exc:
            what = f"key #{i}" + (f" ({key!r})" if key else "")
            raise _fail(p, f"malformed metadata at {what}: {exc}") from None
        if key in metadata:
            warnings.append(f"duplicate metadata key {key!r} (#{i}); the last value wins "
                            f"({metadata[key]!r} -> {_short(val)})")
        metadata[key] = val
        if key in _RAW_KEYS:
            raw_arrays.pop(key, None)
            if endian == "<" and vtype == GGUFValueType.ARRAY and isinstance(val, list) and (not val or isinstance(val[0], str)):
                raw_arrays[key] = bytes(buf[start + 12:ps.pos])
        value_types[key] = GGUFValueType(vtype).name.lower()
        if vtype == GGUFValueType.ARRAY and isinstance(val, np.ndarray):
            value_types[key] = f"array[{val.dtype}]"
        elif vtype == GGUFValueType.ARRAY:
            value_types[key] = "array[string]" if (val and isinstance(val[0], str)) else "array"

    info = GGUFInfo(path=p, version=version, metadata=metadata, warnings=warnings,
                    tensor_count=int(n_tensors), file_size=size,
                    byte_order="little" if endian == "<" else "big", value_types=value_types,
                    raw_arrays=raw_arrays)
    if not want_tensors or n_tensors == 0:
        return info

    tensors: list[TensorInfo] = []
    dim_fmt = "Q"
    for i in range(n_tensors):
        name = None
        try:
            name = ps.string()
            n_dims = ps.scalar("I")
            if n_dims > 8:
                raise ValueError(f"{n_dims} dimensions")
            shape = tuple(ps.scalar(dim_fmt) for _ in range(n_dims))
            ttype = ps.scalar("I")
            offset = ps.scalar("Q")
        except _Truncated:
            what = f"tensor info #{i}" + (f" ({name!r})" if name else "")
            raise _fail(p, f"truncated while reading {what} of {n_tensors}",
                        "the download or copy is incomplete; " + _FIX_HINT) from None
        except ValueError as exc:
            raise _fail(p, f"malformed tensor info #{i}: {exc}") from None
        tensors.append(TensorInfo(name, shape, ttype, offset))

    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    try:
        align = int(align) or DEFAULT_ALIGNMENT
    except (TypeError, ValueError):
        align = DEFAULT_ALIGNMENT
    data_start = (ps.pos + align - 1) // align * align

    n_params = 0
    n_bytes = 0
    by_offset = sorted(tensors, key=lambda t: t.offset)
    data_size = max(0, size - data_start)
    for j, t in enumerate(by_offset):
        n_params += t.n_elements
        nb = t.n_bytes
        if nb is None:  # unknown tensor type: size from the next tensor's offset
            nxt = by_offset[j + 1].offset if j + 1 < len(by_offset) else data_size
            nb = max(0, nxt - t.offset)
        n_bytes += nb
    if tensors:
        last = by_offset[-1]
        end = data_start + last.offset + (last.n_bytes or 0)
        if end > size:
            warnings.append(f"tensor data is truncated: the tensors need {end} bytes but the "
                            f"file has {size}; llama.cpp will refuse to load it")
    info.tensors = tensors
    info.n_params = n_params
    info.tensor_bytes = n_bytes
    return info


def _short(v: Any) -> str:
    r = repr(v.tolist() if isinstance(v, np.ndarray) else v)
    return r if len(r) <= 60 else r[:57] + "..."
