"""Where a stand-in goes: checked before the first byte is written.

A stand-in can be enormous (``--mtp qwen35moe --layers 1000`` is 1.6 TB of F16) and takes minutes, so a folder
that does not exist or a disk that cannot hold it must be found before writing, not after 2 GB or an hour of it.
``check_output`` checks the folder; ``room_check`` gives the writers a check of the free space that they call
once they know the exact size of their tensors, before they open the file.

Peak disk use: the F16 file, plus, for a quantized stand-in, the quantized file that llama.cpp writes beside it
before the F16 one is removed.  The quantized file's size is bounded by Q8_0's 8.5 bits per weight, the widest
type llama.cpp's q8_0 and q4_k_m pick (Q4_K, Q5_K, Q6_K, and the Q5_0/Q5_1/Q8_0 fallbacks for rows that do not
fill 256-wide blocks): at most 34/64 of the F16 file (a real q4_k_m is about 0.3 of it).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Callable

from ...errors import InvalidParameterError
from ...ui import fmt_bytes

QUANTIZED_PER_F16 = 34 / 64  # Q8_0: 34 bytes per 32 weights, against 64 in F16; no type these ftypes pick is wider
TENSOR_INFO_BYTES = 160  # per tensor: its info in the header (name, shape, type, offset) and alignment padding


def metadata_bytes(source_header: int, n_tensors: int) -> int:
    """A stand-in's bytes outside its tensors: the key/values it copies from its source (the source's own header,
    ``source_header`` bytes, bounds them: a 262k-token vocabulary is most of it) and its tensor infos."""
    return source_header + TENSOR_INFO_BYTES * n_tensors


def check_output(out: Path) -> None:
    """Refuse an output the stand-in could not be written to: a folder, or a path whose folder is missing or not
    writable.  Nothing is created: a mistyped ``-o`` is better refused than turned into a new folder tree."""
    out = Path(out)
    folder = out.parent
    if out.is_dir():
        raise InvalidParameterError(f"-o {out} is a folder; give the stand-in's file name, e.g. "
                                    f"-o {out / 'standin.gguf'}")
    if not folder.is_dir():
        raise InvalidParameterError(f"-o {out}: the folder {folder} does not exist; create it first "
                                    f"(mkdir -p {folder}) or write somewhere else")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidParameterError(f"-o {out}: the folder {folder} is not writable; pick a folder you can write to")


def peak_bytes(tensor_bytes: int, meta_bytes: int, quantize_to: str | None) -> tuple[int, str]:
    """The most disk the stand-in takes at once, and what that is made of, in words."""
    f16 = tensor_bytes + meta_bytes
    if quantize_to is None:
        return f16, f"{fmt_bytes(f16)}"
    quantized = int(tensor_bytes * QUANTIZED_PER_F16) + meta_bytes
    return (f16 + quantized, f"up to {fmt_bytes(f16 + quantized)} ({fmt_bytes(f16)} of F16, then the {quantize_to} "
            f"file beside it while llama.cpp quantizes, at most {fmt_bytes(quantized)})")


def check_room(out: Path, tensor_bytes: int, meta_bytes: int, quantize_to: str | None, *, fix: str,
               progress: bool = True) -> None:
    """Refuse a stand-in whose files would not fit in the free space of ``out``'s folder, naming the size, the
    free space and ``fix`` (how to make it smaller); with ``progress``, say the size and the free space in one line."""
    out = Path(out)
    need, what = peak_bytes(tensor_bytes, meta_bytes, quantize_to)
    free = shutil.disk_usage(out.parent).free
    if need > free:
        raise InvalidParameterError(f"{out} needs {what} on disk, but {out.parent} has {fmt_bytes(free)} free; "
                                    f"free some space, write to a folder on a bigger disk (-o), or {fix}")
    if progress:
        print(f"make-standin: writing {out}: {what}; {fmt_bytes(free)} free", file=sys.stderr, flush=True)


def room_check(out: Path, quantize_to: str | None, *, fix: str, progress: bool = True) -> Callable[[int, int], None]:
    """``check_room`` for ``out``, waiting for the tensor and metadata bytes that the writer computes before it
    opens a file."""
    return lambda tensor_bytes, meta_bytes: check_room(out, tensor_bytes, meta_bytes, quantize_to, fix=fix,
                                                       progress=progress)
