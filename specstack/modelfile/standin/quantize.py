"""llama.cpp's quantizer in a child process: with a progress bar, and stopped at once by Ctrl-C or SIGTERM.

Why a child process: ``llama_model_quantize`` is one C call of minutes (4.5 minutes after the F16 of a 6 GB
stand-in) that cannot be asked to stop.  Run in this process, Python's signal handlers get to run only inside
its log callback, where an exception is lost (``llama.backend``): Ctrl-C waited for the whole quantization,
and SIGTERM, which has no handler there, left the F16 file and a half-written output behind.  A child is
killed at once, and its log, which names each tensor as ``[  12/ 291]``, gives the progress bar its count.

The child writes ``OUT.partial``, renamed to ``OUT`` only once llama.cpp reports success, so no half file is
ever left under the real name; whatever ends the parent early kills the child and removes ``OUT.partial``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import IO

from ...errors import InvalidParameterError
from ...ui import Progress
from .shape import StandinError

QUANTIZE_FTYPES = ("q8_0", "q4_k_m")
_TENSOR = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")  # llama-quant.cpp: "[%4d/%4d] %-36s - [...], type = ..."
_CHILD = "import sys; from specstack.modelfile.standin.quantize import child_main; sys.exit(child_main(sys.argv[1:]))"
_REPO = Path(__file__).resolve().parents[3]  # the folder holding the package this process imported


def run_quantizer(src: Path, out: Path, ftype: str, *, threads: int = 2, progress: bool = True,
                  verbose: bool = False) -> Path:
    """Quantize the GGUF ``src`` to ``ftype`` at ``out`` with llama.cpp (``llama_model_quantize``) in a child
    process, showing a progress bar of its tensors (``progress``) and llama.cpp's whole log (``verbose``)."""
    if ftype not in QUANTIZE_FTYPES:
        raise InvalidParameterError(f"cannot quantize to {ftype!r}; choose one of {', '.join(QUANTIZE_FTYPES)}")
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(src), str(tmp), ftype, str(threads)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=_child_env(), text=True, errors="replace")
    try:
        tail = _follow(proc.stderr, ftype, quiet=not progress, verbose=verbose)
        code = proc.wait()
        if code != 0:
            said = " | ".join(line for line in tail if line) or "no message"
            raise StandinError(f"llama.cpp failed to quantize {src} to {ftype} (exit status {code}): {said}")
        os.replace(tmp, out)
    finally:
        if proc.poll() is None:  # an exception (Ctrl-C, SIGTERM, a failure here) ends the quantization too
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
        tmp.unlink(missing_ok=True)
    return out


def _follow(log: IO[str] | None, ftype: str, *, quiet: bool, verbose: bool) -> deque[str]:
    """Read the child's log to its end, advancing a progress bar per tensor; return its last lines (for errors)."""
    tail: deque[str] = deque(maxlen=8)
    tick: Progress | None = None
    if log is None:
        return tail
    try:
        for line in log:
            if verbose:
                sys.stderr.write(line)
            tail.append(line.strip())
            match = _TENSOR.match(line)
            if match is None:
                continue
            done, total = int(match.group(1)), int(match.group(2))
            if tick is None:
                tick = Progress(f"make-standin: quantizing to {ftype}", total, unit="tensors", quiet=quiet)
                tick.update(0)  # at once: the first tensor can take a while
            tick.update(done, note=line[match.end():].split(" - ", 1)[0].strip())
    finally:
        if tick is not None:
            tick.close()
    return tail


def _child_env() -> dict[str, str]:
    """This environment, with the package this process runs first on the child's path (a checkout, not another
    install), and the child's output unbuffered so each tensor's line arrives as it is done."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def child_main(argv: list[str]) -> int:
    """The child: ``SRC OUT FTYPE THREADS``; llama.cpp's log goes to stderr, where the parent reads it."""
    from ...llama import quantize, set_verbose

    src, out, ftype, threads = argv
    set_verbose(True)
    return quantize(Path(src), Path(out), ftype, threads=int(threads))
