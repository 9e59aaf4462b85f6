"""Reading the source GGUF: its shape, single fields, and its tensors as floats.

Only F32/F16/BF16 source tensors are read: stand-ins are padded from float weights and quantized
afterwards (``make``), never from an already quantized source.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import ModelLoadError, UnsupportedModelError
from .shape import ARCHS, LlamaShape

if TYPE_CHECKING:  # gguf is imported lazily: the rest of specstack runs without it
    from gguf import GGUFReader, ReaderTensor


def read_field(reader: GGUFReader, key: str) -> Any:
    """The value of field ``key``, or None when the source lacks it (callers decide if that is fatal)."""
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read_shape(reader: GGUFReader) -> LlamaShape:
    """The shape of an open ``gguf.GGUFReader`` (llama or lfm2); raises for anything else."""
    arch = read_field(reader, "general.architecture")
    if arch not in ARCHS:
        raise UnsupportedModelError(
            f"stand-ins need a llama-architecture or lfm2 model; this one is {arch!r}")

    def need(key: str) -> int:
        v = read_field(reader, f"{arch}.{key}")
        if not isinstance(v, int):
            raise UnsupportedModelError(f"source lacks a single integer {arch}.{key} (got {v!r})")
        return v

    d, n_head, n_layer = need("embedding_length"), need("attention.head_count"), need("block_count")
    kv = read_field(reader, f"{arch}.attention.head_count_kv")
    if arch == "lfm2":
        layer_kv = tuple(kv) if isinstance(kv, list) else (kv,) * n_layer if isinstance(kv, int) else None
        if layer_kv is None or len(layer_kv) != n_layer:
            raise UnsupportedModelError(f"source lacks {arch}.attention.head_count_kv for each of its {n_layer} layers")
        n_head_kv = next((k for k in layer_kv if k), 0)
        l_cache = need("shortconv.l_cache")
    else:
        if not isinstance(kv, int):
            raise UnsupportedModelError(f"source lacks a single integer {arch}.attention.head_count_kv (got {kv!r})")
        layer_kv, n_head_kv, l_cache = (), kv, 0
    head_dim = read_field(reader, f"{arch}.attention.key_length") or d // n_head
    if (read_field(reader, f"{arch}.attention.value_length") or head_dim) != head_dim:
        raise UnsupportedModelError("stand-ins need the same key and value head size")
    if head_dim * n_head != d and arch != "gemma3":  # gemma3 reads its head_dim from key_length
        raise UnsupportedModelError(f"stand-ins of {arch} need head_dim x n_head == embedding_length")
    for k in layer_kv or (n_head_kv,):
        if k and n_head % k:
            raise UnsupportedModelError(f"n_head {n_head} is not a multiple of n_head_kv {k}")
    names = {t.name for t in reader.tensors}
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise UnsupportedModelError("source has no token_embd.weight")
    n_expert = read_field(reader, f"{arch}.expert_count") or 0
    if n_expert and arch != "llama":
        raise UnsupportedModelError(f"stand-ins support mixture-of-experts llama models only, not {arch}")
    n_ff = (read_field(reader, f"{arch}.expert_feed_forward_length") or need("feed_forward_length")) if n_expert \
        else need("feed_forward_length")
    quantized, row_blocks = _quantization(reader) if arch == "gemma3" else (None, (1, 1, 1))
    return LlamaShape(n_embd=d, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
                      head_dim=head_dim, n_ff=n_ff, n_vocab=int(emb.shape[1]),
                      tied_output="output.weight" not in names, n_expert=n_expert,
                      n_expert_used=read_field(reader, f"{arch}.expert_used_count") or 0,
                      arch=arch, layer_kv=layer_kv, l_cache=l_cache, quantized=quantized, row_blocks=row_blocks)


_FLOAT_TYPES = ("F32", "F16", "BF16")
# llama.cpp file types (general.file_type) a stand-in's --ftype names
FTYPE_IDS = {"f16": 1, "q8_0": 7, "q4_k_m": 15}


def _quantization(reader: GGUFReader) -> tuple[str | None, tuple[int, int, int]]:
    """A gemma3 source's ftype name when any tensor is quantized (None: a float source), and the
    largest quant block length over the tensors whose rows are n_embd, n_head x head_dim and n_ff
    long (a quantized stand-in copies the source's blocks, so its wider rows must fill whole blocks)."""
    from gguf.constants import GGML_QUANT_SIZES

    blocks = [1, 1, 1]
    quantized = False
    for t in reader.tensors:
        if t.tensor_type.name in _FLOAT_TYPES:
            continue
        quantized = True
        kind = t.name.rsplit(".", 2)[-2]
        k = 1 if kind == "attn_output" else 2 if kind == "ffn_down" else 0
        blocks[k] = max(blocks[k], GGML_QUANT_SIZES[t.tensor_type][0])
    if not quantized:
        return None, (1, 1, 1)
    ft = read_field(reader, "general.file_type")
    name = next((n for n, i in FTYPE_IDS.items() if i == ft), f"file type {ft}")
    return name, (blocks[0], blocks[1], blocks[2])


def open_source(path: Path) -> GGUFReader:
    """Open the source GGUF, turning "missing" and "not a GGUF" into ModelLoadError for the CLI."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"source model {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/struct errors on non-GGUF input
        raise ModelLoadError(f"cannot read {path} as GGUF: {exc}") from exc


def read_source_shape(path: Path) -> LlamaShape:
    """The shape of the GGUF at ``path`` (ModelLoadError when it is missing or not a GGUF)."""
    return read_shape(open_source(path))


def as_float(t: ReaderTensor, *, dequantize: bool = False) -> np.ndarray:
    """Tensor ``t`` as F16/F32 numbers (BF16 dequantized). Quantized source tensors are refused
    unless ``dequantize`` (gemma3 sources: an F16 stand-in of a quantized source): llama and lfm2
    stand-ins are padded from float weights and quantized afterwards with ``--ftype``."""
    from gguf import GGMLQuantizationType as Q

    if t.tensor_type in (Q.F16, Q.F32):
        return np.asarray(t.data)
    if t.tensor_type == Q.BF16 or dequantize:
        from gguf.quants import dequantize as deq

        return deq(np.asarray(t.data), t.tensor_type)
    raise UnsupportedModelError(
        f"tensor {t.name} is {t.tensor_type.name}; make stand-ins from an F32/F16/BF16 source and "
        f"quantize with --ftype instead (quantized sources are supported for gemma3 only)")


def as_blocks(t: ReaderTensor) -> tuple[np.ndarray, int]:
    """A quantized 2-D tensor as its raw quant blocks [rows, blocks per row, bytes per block], and
    the block length in elements (stand-ins of quantized sources copy and zero-pad whole blocks)."""
    from gguf.constants import GGML_QUANT_SIZES

    block, nbytes = GGML_QUANT_SIZES[t.tensor_type]
    a = np.asarray(t.data)
    return a.reshape(a.shape[0], -1, nbytes), block
