"""Making a stand-in file: ``make_standin`` (the entry point) and ``quantize_gguf``.

Quantized stand-ins are written as F16 first and quantized by llama.cpp's own quantizer, so their
blocks are exactly the blocks llama.cpp would make from the source (see ``plan`` for the checks
that make this hold).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Callable

from ...errors import InvalidParameterError
from .shape import FTYPES, StandinError
from .writer import write_standin_f16


def quantize_gguf(src: Path, out: Path, ftype: str, *, threads: int = 2, verbose: bool = False) -> Path:
    """Quantize a GGUF with llama.cpp's own quantizer (``llama_model_quantize``, via target.py)."""
    from ...llama import quantize

    if ftype not in ("q8_0", "q4_k_m"):
        raise InvalidParameterError(f"cannot quantize to {ftype!r}; choose one of q8_0, q4_k_m")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = logging.getLogger("llama-cpp-python")  # llama-cpp-python's log callback filters on it
    old_level = log.level
    log.setLevel(logging.DEBUG if verbose else logging.ERROR)
    try:
        rc = quantize(src, out, ftype, threads=threads)
    finally:
        log.setLevel(old_level)
    if rc != 0:
        raise StandinError(f"llama.cpp failed to quantize {src} to {ftype} (return code {rc})")
    return out


def make_standin(src: Path, out: Path, width: int, layers: int, ftype: str = "f16", *,
                 ffn: int | None = None, threads: int = 2, progress: bool = True,
                 kv_heads: int | None = None, attn_layers: int | None = None, heads: int | None = None) -> Path:
    """Write a stand-in of ``src`` with hidden size ``width`` and ``layers`` layers to ``out``.

    The FFN grows in proportion to ``width`` unless ``ffn`` is given. ``ftype`` "f16" writes the
    padded model directly; "q8_0" and "q4_k_m" write it to a temporary F16 file next to ``out``
    and quantize that with llama.cpp. ``kv_heads`` and ``attn_layers`` (LFM2) are as in
    ``plan_standin``. A quantized gemma3 source: "f16" dequantizes it; its own ftype copies its
    quant blocks (no requantization); any other ftype is refused. Returns ``out``.
    """
    from .source import read_source_shape

    out = Path(out)
    if ftype not in FTYPES:
        raise InvalidParameterError(f"unknown ftype {ftype!r}; choose one of {', '.join(FTYPES)}")
    kw = {"ffn": ffn, "progress": progress, "kv_heads": kv_heads, "attn_layers": attn_layers, "heads": heads}
    if ftype == "f16":
        write_standin_f16(Path(src), out, width, layers, **kw)
        return out
    if read_source_shape(Path(src)).quantized is not None:  # keeps the source's quant blocks
        write_standin_f16(Path(src), out, width, layers, ftype_for_checks=ftype, **kw)
        return out
    quantized_from_f16(out, ftype, lambda tmp: write_standin_f16(Path(src), tmp, width, layers,
                                                               ftype_for_checks=ftype, **kw),
                       threads=threads, progress=progress)
    return out


def quantized_from_f16(out: Path, ftype: str, write_f16: Callable[[Path], object], *, threads: int = 2,
                       progress: bool = True) -> None:
    """Write ``out`` in ``ftype`` by having ``write_f16`` write an F16 file beside it, then quantizing that with
    llama.cpp (the F16 file is removed, whatever happens)."""
    tmp = out.with_name(out.name + ".f16.partial")
    try:
        write_f16(tmp)
        if progress:
            print(f"make-standin: quantizing to {ftype} with llama.cpp", file=sys.stderr, flush=True)
        quantize_gguf(tmp, out, ftype, threads=threads)
    finally:
        tmp.unlink(missing_ok=True)
