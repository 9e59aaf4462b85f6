"""A small, tolerant GGUF binary reader: what the file says, not what it means.

Reads the header, the key/value section and the tensor infos of a GGUF file
(v2, v3; little- or big-endian) without ever touching tensor data, so it is
fast even on multi-gigabyte models and on 100k-token vocabularies.

Hand-written on purpose rather than ``gguf.GGUFReader``: it tolerates duplicated
keys (the last value wins and a warning is recorded), every problem with the
file becomes a ``ModelLoadError`` that names the file, what was wrong and what
to do, and string arrays are decoded in one tight loop.  The type tables still
come from the ``gguf`` package, pinned beside llama-cpp-python, so they follow
ggml as it adds types.  ``gguf_meta.GGUFInfo`` adds the interpretation.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import gguf
import numpy as np
from gguf import GGUFValueType

from ..errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = gguf.GGUF_DEFAULT_ALIGNMENT

# numpy dtype per scalar value type, as stored (a bool is one byte; any non-zero byte is true):
_NP_DTYPE = {t: np.dtype(np.uint8 if t == GGUFValueType.BOOL else np_type)
             for t, np_type in gguf.GGUFReader.gguf_scalar_to_np.items()}

# sanity limits that tell garbage from a merely truncated file
_MAX_STRING = 1 << 32
_MAX_COUNT = 1 << 32
# string arrays whose stored bytes are kept: hashing them is faster than re-encoding 100k strings
_RAW_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
_FIX_HINT = "re-download or re-convert the model (e.g. with llama.cpp's convert_hf_to_gguf.py)"
_INCOMPLETE_HINT = "the download or copy is incomplete; " + _FIX_HINT


def ggml_type_name(ggml_type: int) -> str:
    """A tensor type's ggml name (``F16``, ``Q4_K``); ``typeN`` for one this gguf package does not know."""
    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type{ggml_type}"


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
class GGUFFile:
    """Everything in a GGUF file except the tensor data, as stored."""

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
    # raw little-endian bytes (u64 length + UTF-8, per string) of the big string arrays
    raw_arrays: dict[str, bytes] = field(default_factory=dict, repr=False)


F = TypeVar("F", bound=GGUFFile)


class _Truncated(Exception):
    """The file ends inside a field: told apart from garbage (``ValueError``) for the message."""


class _Parser:
    """A cursor over the file's bytes in one byte order; raises ``_Truncated`` past the end."""

    def __init__(self, buf, size: int, endian: str, pos: int = 0):
        self.buf = buf
        self.size = size
        self.pos = pos
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
        """``count`` strings in one loop with locals: the vocabulary is most of the metadata."""
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


def check_gguf_file(path: str | os.PathLike, role: str = "model") -> Path:
    """Fail early, clearly, on a missing or non-GGUF file, naming its ``role`` (the target, a draft model):
    llama.cpp would only say 'failed'."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"{role} file not found: {p}; pass an existing .gguf file (see `specstack models scan DIR`)")
    if p.is_dir():
        raise ModelLoadError(f"{role} path is a directory, not a GGUF file: {p}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(
            f"{role} file is not GGUF (starts with {magic!r}, expected b'GGUF'): {p}; "
            "convert it with llama.cpp's convert_hf_to_gguf.py or pick a .gguf file"
        )
    return p


def read_gguf_file(path: str | os.PathLike, into: type[F], *, tensors: bool = True, role: str | None = None) -> F:
    """Read the metadata (and tensor infos) of a GGUF file into an ``into`` without reading tensor data.

    ``into`` is the result class (``GGUFInfo``), so that the interpreting
    subclass is built directly rather than copied from a ``GGUFFile``.
    Raises ``ModelLoadError`` for a missing, unreadable, non-GGUF, truncated or
    malformed file; with ``role``, a missing or non-GGUF one is named by it (``check_gguf_file``).
    """
    p = Path(path) if role is None else check_gguf_file(path, role)
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
        except (OSError, ValueError):  # a pipe or special file: read it whole instead
            mm = None
        buf = mm if mm is not None else f.read()
        try:
            return _parse(p, buf, size, tensors, into)
        finally:
            if mm is not None:
                mm.close()


def _parse(p: Path, buf, size: int, want_tensors: bool, into: type[F]) -> F:
    ps, version, n_tensors, n_kv = _read_header(p, buf, size)
    metadata, warnings, raw_arrays = _read_kvs(p, ps, n_kv)
    info = into(path=p, version=version, metadata=metadata, warnings=warnings,
                tensor_count=int(n_tensors), file_size=size,
                byte_order="little" if ps.e == "<" else "big", raw_arrays=raw_arrays)
    if not want_tensors or n_tensors == 0:
        return info
    info.tensors = _read_tensor_infos(p, ps, n_tensors)
    data_start = _data_start(ps.pos, metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    by_offset = sorted(info.tensors, key=lambda t: t.offset)
    info.n_params, info.tensor_bytes = _tensor_totals(by_offset, max(0, size - data_start))
    warning = _truncation_warning(by_offset[-1], data_start, size)
    if warning:
        warnings.append(warning)
    return info


def _read_header(p: Path, buf, size: int) -> tuple[_Parser, int, int, int]:
    """Magic, version (which also tells the byte order) and the two counts; a parser placed after them."""
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
    ps = _Parser(buf, size, endian, pos=8)
    try:
        n_tensors = ps.scalar("Q")
        n_kv = ps.scalar("Q")
    except _Truncated:
        raise _fail(p, "truncated while reading the header") from None
    if n_kv > _MAX_COUNT or n_tensors > _MAX_COUNT:
        raise _fail(p, f"malformed header (claims {n_kv} metadata keys and {n_tensors} tensors "
                       f"in a {size}-byte file)")
    return ps, version, n_tensors, n_kv


def _read_kvs(p: Path, ps: _Parser, n_kv: int) -> tuple[dict[str, Any], list[str], dict[str, bytes]]:
    """The key/value section: metadata (last duplicate wins), warnings, raw bytes of ``_RAW_KEYS``."""
    metadata: dict[str, Any] = {}
    warnings: list[str] = []
    raw_arrays: dict[str, bytes] = {}
    for i in range(n_kv):
        key = None
        try:
            key = ps.string()
            vtype = ps.scalar("I")
            start = ps.pos
            val = ps.value(vtype)
        except _Truncated:
            what = f"key #{i}" + (f" ({key!r})" if key else "")
            raise _fail(p, f"truncated while reading {what} of {n_kv} (file is {ps.size} bytes)",
                        _INCOMPLETE_HINT) from None
        except ValueError as exc:
            what = f"key #{i}" + (f" ({key!r})" if key else "")
            raise _fail(p, f"malformed metadata at {what}: {exc}") from None
        if key in metadata:
            warnings.append(f"duplicate metadata key {key!r} (#{i}); the last value wins "
                            f"({metadata[key]!r} -> {_short(val)})")
        metadata[key] = val
        if key in _RAW_KEYS:
            raw_arrays.pop(key, None)
            if _is_le_string_array(ps, vtype, val):
                raw_arrays[key] = bytes(ps.buf[start + 12:ps.pos])  # after element type (u32) and count (u64)
    return metadata, warnings, raw_arrays


def _is_le_string_array(ps: _Parser, vtype: int, val: Any) -> bool:
    """Stored bytes equal what ``string_array_bytes`` would build only for little-endian string arrays."""
    return (ps.e == "<" and vtype == GGUFValueType.ARRAY and isinstance(val, list)
            and (not val or isinstance(val[0], str)))


def _read_tensor_infos(p: Path, ps: _Parser, n_tensors: int) -> list[TensorInfo]:
    tensors: list[TensorInfo] = []
    for i in range(n_tensors):
        name = None
        try:
            name = ps.string()
            n_dims = ps.scalar("I")
            if n_dims > 8:
                raise ValueError(f"{n_dims} dimensions")
            shape = tuple(ps.scalar("Q") for _ in range(n_dims))
            ttype = ps.scalar("I")
            offset = ps.scalar("Q")
        except _Truncated:
            what = f"tensor info #{i}" + (f" ({name!r})" if name else "")
            raise _fail(p, f"truncated while reading {what} of {n_tensors}", _INCOMPLETE_HINT) from None
        except ValueError as exc:
            raise _fail(p, f"malformed tensor info #{i}: {exc}") from None
        tensors.append(TensorInfo(name, shape, ttype, offset))
    return tensors


def _data_start(end_of_infos: int, alignment: Any) -> int:
    """Where tensor data begins: the end of the tensor infos rounded up to ``general.alignment``."""
    try:
        align = int(alignment) or DEFAULT_ALIGNMENT
    except (TypeError, ValueError):
        align = DEFAULT_ALIGNMENT
    return (end_of_infos + align - 1) // align * align


def _tensor_totals(by_offset: list[TensorInfo], data_size: int) -> tuple[int, int]:
    """Parameters and bytes of tensor data (tensors sorted by offset: a type this gguf package does not
    know is sized up to the next tensor)."""
    n_params = 0
    n_bytes = 0
    for j, t in enumerate(by_offset):
        n_params += t.n_elements
        nb = t.n_bytes
        if nb is None:  # unknown tensor type: size from the next tensor's offset
            nxt = by_offset[j + 1].offset if j + 1 < len(by_offset) else data_size
            nb = max(0, nxt - t.offset)
        n_bytes += nb
    return n_params, n_bytes


def _truncation_warning(last: TensorInfo, data_start: int, size: int) -> str | None:
    """llama.cpp refuses a file whose last tensor runs past its end; say so without failing the read."""
    end = data_start + last.offset + (last.n_bytes or 0)
    if end <= size:
        return None
    return (f"tensor data is truncated: the tensors need {end} bytes but the "
            f"file has {size}; llama.cpp will refuse to load it")


def _short(v: Any) -> str:
    r = repr(v.tolist() if isinstance(v, np.ndarray) else v)
    return r if len(r) <= 60 else r[:57] + "..."
