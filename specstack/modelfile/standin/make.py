"""Making a stand-in file: ``make_standin`` (the entry point) and ``quantize_gguf``.

Quantized stand-ins are written as F16 first and quantized by llama.cpp's own quantizer, so their
blocks are exactly the blocks llama.cpp would make from the source (see ``plan`` for the checks
that make this hold).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ...errors import InvalidParameterError
from .output import check_output, room_check
from .quantize import run_quantizer
from .shape import FTYPES
from .writer import write_standin_f16

# What a stand-in too big for the disk can give up (the padded kind; ``mtp`` names its own).
SMALLER = "make a smaller stand-in (fewer --layers, a smaller --width or --ffn)"


def quantize_gguf(src: Path, out: Path, ftype: str, *, threads: int = 2, verbose: bool = False,
                  progress: bool = False) -> Path:
    """Quantize a GGUF with llama.cpp's own quantizer (``llama_model_quantize``), in a child process that Ctrl-C
    and SIGTERM stop at once (``quantize``), with a progress bar of its tensors if ``progress``."""
    check_output(Path(out))
    return run_quantizer(Path(src), Path(out), ftype, threads=threads, progress=progress, verbose=verbose)


def make_standin(src: Path, out: Path, width: int, layers: int, ftype: str = "f16", *,
                 ffn: int | None = None, threads: int = 2, progress: bool = True,
                 kv_heads: int | None = None, attn_layers: int | None = None, heads: int | None = None,
                 vocab: int | None = None) -> Path:
    """Write a stand-in of ``src`` with hidden size ``width`` and ``layers`` layers to ``out``.

    The FFN grows in proportion to ``width`` unless ``ffn`` is given. ``ftype`` "f16" writes the
    padded model directly; "q8_0" and "q4_k_m" write it to a temporary F16 file next to ``out``
    and quantize that with llama.cpp. ``kv_heads`` and ``attn_layers`` (LFM2) are as in
    ``plan_standin``. A quantized gemma3 source: "f16" dequantizes it; its own ftype copies its
    quant blocks (no requantization); any other ftype is refused. ``vocab`` (gemma3 only) keeps that many
    of the source's tokens (the ``vocab`` module), for an output layer of a real model's size. Returns ``out``.

    Before writing anything, the output's folder must exist and be writable, and the files must fit in its free
    space (``output``); a failed or interrupted write leaves no file behind, partial or whole.
    """
    from .source import read_source_shape

    out = Path(out)
    if ftype not in FTYPES:
        raise InvalidParameterError(f"unknown ftype {ftype!r}; choose one of {', '.join(FTYPES)}")
    check_output(out)
    kw = {"ffn": ffn, "progress": progress, "kv_heads": kv_heads, "attn_layers": attn_layers, "heads": heads,
          "vocab": vocab}
    if ftype == "f16" or read_source_shape(Path(src)).quantized is not None:  # f16, or the source's quant blocks
        write_standin_f16(Path(src), out, width, layers, ftype_for_checks=ftype,
                          before_write=room_check(out, None, fix=SMALLER, progress=progress), **kw)
        return out
    quantized_from_f16(out, ftype, lambda tmp: write_standin_f16(
        Path(src), tmp, width, layers, ftype_for_checks=ftype,
        before_write=room_check(out, ftype, fix=SMALLER, progress=progress), **kw), threads=threads, progress=progress)
    return out


def quantized_from_f16(out: Path, ftype: str, write_f16: Callable[[Path], object], *, threads: int = 2,
                       progress: bool = True) -> None:
    """Write ``out`` in ``ftype`` by having ``write_f16`` write an F16 file beside it, then quantizing that with
    llama.cpp (the F16 file is removed, whatever happens)."""
    tmp = out.with_name(out.name + ".f16.partial")
    try:
        write_f16(tmp)
        quantize_gguf(tmp, out, ftype, threads=threads, progress=progress)
    finally:
        tmp.unlink(missing_ok=True)
